from deltafin.cli.commands import main

raise SystemExit(main())
