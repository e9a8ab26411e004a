from predictor.sidecar.app import main

raise SystemExit(main())
