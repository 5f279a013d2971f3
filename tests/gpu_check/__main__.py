import sys

from tests.gpu_check.check import main

sys.exit(main())
