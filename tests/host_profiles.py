"""The shipped CPU profile without its host-path block (hkvsim calibrate --host writes one): the
base the host-model tests add their own constants to, so they do not depend on the calibrated
values."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hkvsim.validate_fit import replace_host_block

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "hkvsim/fabric/profiles/cpu-ucx-loopback.toml"
_DIR = Path(tempfile.mkdtemp(prefix="hkvsim-test-profile-"))
#: path of cpu-ucx-loopback without the host-path model
CPU_BASE = _DIR / "cpu-ucx-loopback-base.toml"
CPU_BASE.write_text(replace_host_block(SHIPPED.read_text(), None))
