import sys

from control_svc.serve import main

sys.exit(main())
