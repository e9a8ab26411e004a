from predictor.sidecar.cli import main

raise SystemExit(main())
