"""Print the requirements of one of hicache's optional extras, one per line.

The CI install steps install an extra's packages with this instead of
``pip install -e '.[EXTRA]'``, which would rebuild hicache itself (and compile its
native extension again) just to add the extra's dependencies. Reads the metadata of
the hicache that ``make install`` installed, so the extras stay defined in one place
(pyproject.toml).
"""

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

extra = sys.argv[1]
for line in requires("hicache") or []:
    req = Requirement(line)
    if req.marker is not None and req.marker.evaluate({"extra": extra}):
        req.marker = None
        print(req)
