from pyinfinity.cli import main

raise SystemExit(main())
