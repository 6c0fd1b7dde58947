from lengthwise.cli import main

raise SystemExit(main())
