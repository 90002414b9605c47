from scripts.slime_loop.main import main

raise SystemExit(main())
