"""The acme platform plugin: one hook, detection. Everything else acme answers is a method of
`AcmePlatform`, which the engine reaches through the hooks' default implementations.

Importing this module is cheap and never fails for want of a device: a missing device is a
candidate with `platform=None` and the reason.
"""
from __future__ import annotations

import os

from runtime.plugins.hookspecs import HOOK_API_VERSION, hookimpl
from runtime.plugins.interfaces import PlatformCandidate

RUNTIME_HOOK_API_VERSION = HOOK_API_VERSION  # written for this contract; checked at load
ACME_PRIORITY = 10  # above the CPU platform (0), below the GPU platforms (100)
VISIBLE_ENV = "ACME_VISIBLE_DEVICES"  # "" hides the device, as CUDA_VISIBLE_DEVICES does


@hookimpl
def runtime_detect_platforms() -> list[PlatformCandidate]:
    if os.environ.get(VISIBLE_ENV) == "":
        return [PlatformCandidate("acme", None, ACME_PRIORITY, f"{VISIBLE_ENV} is empty")]
    from runtime_acme.platform import AcmePlatform
    return [PlatformCandidate("acme", AcmePlatform(), ACME_PRIORITY)]
