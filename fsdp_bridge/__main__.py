import sys

from fsdp_bridge.cli import main

sys.exit(main())
