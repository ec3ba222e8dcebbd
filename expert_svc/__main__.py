import sys

from expert_svc.serve import main

sys.exit(main())
