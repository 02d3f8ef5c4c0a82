from deltafin.cli import main

raise SystemExit(main())
