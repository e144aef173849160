import sys

from scripts.bench import main

sys.exit(main())
