"""What the package logs reaches a user who configured no logging: WARNING and above on stderr
(e.g. the removal of a crashed run's swap files), INFO not; once the application configures
logging, records go its way only (never twice)."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging, sys
import pyinfinity
{setup}
log = logging.getLogger("pyinfinity.swap.ownership")
log.info("an info line")
log.warning("stale swap files removed")
"""


def run(setup: str = "") -> str:
    p = subprocess.run([sys.executable, "-c", SCRIPT.format(setup=setup)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stderr


def test_warnings_reach_a_user_who_configured_nothing_and_info_stays_quiet():
    err = run()
    assert "stale swap files removed" in err and "WARNING" in err
    assert "an info line" not in err


def test_a_configured_application_gets_each_record_once_its_own_way():
    err = run("logging.basicConfig(level=logging.INFO, format='APP %(levelname)s %(message)s', stream=sys.stderr)")
    assert err.count("stale swap files removed") == 1 and "APP WARNING stale swap files removed" in err
    assert "APP INFO an info line" in err
