import sys

from vllm_mla_fixes.cli import main

sys.exit(main())
