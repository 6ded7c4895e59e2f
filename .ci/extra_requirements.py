"""Print the requirements of one of hicache's optional extras, one per line.

The CI install steps install an extra's packages with this instead of
``pip install -e '.[EXTRA]'``, which would rebuild hicache itself (and compile its
native extension again) just to add the extra's dependencies. Reads the metadata of
the hicache that ``make install`` installed, so the extras stay defined in one place
(pyproject.toml).
"""

import sys
from importlib.metadata import metadata, requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

extra = sys.argv[1]
known = {canonicalize_name(e) for e in metadata("hicache").get_all("Provides-Extra") or []}
if canonicalize_name(extra) not in known:
    # Printing nothing would make the caller's `pip install` fail with pip's own,
    # unrelated message; an installed hicache older than pyproject.toml lacks new extras.
    print(f"extra_requirements: the installed hicache has no extra {extra!r} (it has: "
          f"{', '.join(sorted(known))}); run 'make install' again", file=sys.stderr)
    sys.exit(2)
for line in requires("hicache") or []:
    req = Requirement(line)
    if req.marker is not None and req.marker.evaluate({"extra": extra}):
        req.marker = None
        print(req)
