"""The simulator's own error: an action list that cannot run."""

from basics.errors import InputError


class ScheduleError(InputError):
    """An action list that cannot run: a missing, repeated or misplaced action, or a deadlock."""
