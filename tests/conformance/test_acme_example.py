"""The example third-party platform (examples/acme_platform), installed as a vendor would ship
it, passes the conformance suite, and the run says that acme's own code answered."""
import os
import subprocess
import sys
from pathlib import Path

from runtime.testing.install import install_into

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "acme_platform"


def test_the_example_platform_installs_and_passes_the_conformance_suite(tmp_path):
    site = install_into(EXAMPLE, tmp_path)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RUNTIME_PLUGINS", "RUNTIME_DEVICE", "ACME_VISIBLE_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "runtime.testing.conformance", "--device", "acme",
                           "-p", "no:cacheprovider", "-rs"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    assert "failed" not in out.strip().splitlines()[-1]
    for line in ("runtime_attention_backend [float32]: acme_paged (acme platform)",
                 "runtime_attention_backend [bfloat16]: acme_paged (acme platform)",
                 "runtime_custom_op [rms_norm]: acme_rms_norm (acme platform)",
                 "runtime_custom_op [add_rms_norm]: composed (composed from rms_norm (acme "
                 "platform))"):
        assert line in out, out[:3000]
