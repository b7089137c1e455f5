"""UCX in these tests talks over loopback only: pin it before anything imports ucxx."""

import os

from kvcore.transfer.ucx import LOOPBACK_ENV

os.environ.update(LOOPBACK_ENV)
