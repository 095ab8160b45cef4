"""A rank entry for the zygote's tests: prints its pid, session and argv, then exits with ``--code`` or sleeps.

    python -m tests.support.zygote_child --code N | --sleep S   (or a rank's arguments: sleeps ZYGOTE_CHILD_SLEEP s)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--code", type=int, default=0)
    p.add_argument("--sleep", type=float, default=float(os.environ.get("ZYGOTE_CHILD_SLEEP", "0")))
    p.add_argument("--raise", dest="boom", action="store_true")
    a, _ = p.parse_known_args()  # a rank's own arguments (from LocalLauncher) are ignored
    print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "argv": sys.argv[1:],
                      "torch_loaded": "torch" in sys.modules}), flush=True)
    if a.boom:
        raise RuntimeError("boom from the child")
    time.sleep(a.sleep)
    sys.exit(a.code)
