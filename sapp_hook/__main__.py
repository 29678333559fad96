from sapp_hook.cli import main

raise SystemExit(main())
