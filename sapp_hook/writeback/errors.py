"""The write-back's own error: a plan the config it is written into cannot run."""

from basics.errors import InputError

PLAN = "--plan"


class PlanMismatch(InputError):
    """What the plan says that the config cannot run, as a predicate whose subject is the plan ("is for 4
    micro-batches; ...", "places 30 decoder layers; ..."). Writing a plan names the plan (`--plan: is for ...`);
    checking a config before any plan exists names the config (`train.yaml does not fit this job: the plan is
    for ...`)."""

    def __init__(self, predicate: str) -> None:
        super().__init__(PLAN, predicate)
        self.predicate = predicate
