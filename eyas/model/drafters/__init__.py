"""Drafter networks for EAGLE-1, EAGLE-3 and MTP, and their public checkpoint layouts.

``base``: the step interface and declared needs; ``eagle1``, ``eagle3``, ``mtp``: the networks;
``checkpoint``: reading (``load_drafter``, ``read_drafter_spec``); ``save``: writing
(``save_drafter``); ``layout``: tensor names and files shared by both.
"""

from eyas.model.drafters.base import Drafter, TargetParts
from eyas.model.drafters.checkpoint import DrafterSpec, load_drafter, read_drafter_spec
from eyas.model.drafters.eagle1 import Eagle1Drafter
from eyas.model.drafters.eagle3 import Eagle3Drafter
from eyas.model.drafters.mtp import MtpDrafter
from eyas.model.drafters.save import save_drafter

__all__ = ["Drafter", "DrafterSpec", "Eagle1Drafter", "Eagle3Drafter", "MtpDrafter", "TargetParts", "load_drafter",
           "read_drafter_spec", "save_drafter"]
