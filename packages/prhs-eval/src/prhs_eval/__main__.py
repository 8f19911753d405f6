"""``python -m prhs_eval`` runs the ``prhs-eval`` command line."""

from prhs_eval.cli import main

raise SystemExit(main())
