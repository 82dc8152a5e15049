"""Where a benchmark ran from: the commit to record in its JSON."""
import os
import subprocess


def git_commit() -> str:
    """NVFP4_COMMIT if set (the lent GPU machines get a copy without .git), else git HEAD, else "unknown"."""
    if os.environ.get("NVFP4_COMMIT"):
        return os.environ["NVFP4_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
