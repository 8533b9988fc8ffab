from detscale.cli import main

raise SystemExit(main())
