"""The version rule: which silos may serve a call to one method of a grain type.

Each silo hosts one ``@version`` of each of its grain types (its membership
row's ``grain_versions``); each version has its own method list (the
manifests, :mod:`silo.messaging.manifests`). Orleans' compatibility rule,
simplified to method lists:

* an activation of version v may serve a call of method m iff v's method list
  has m;
* a new activation (a first call, or a call re-placed because the existing
  activation's version lacks the method) goes to a silo hosting the *newest*
  version, among the active silos' versions, that has m;
* a silo whose version of the type is older than that creates no new
  activation of it (it turns the call away, unrun, and the caller places it
  again); an activation it already has keeps serving the methods its version
  has, until it is collected, drained or re-placed.

* an activation moves only to a newer version: a call of a method that only
  versions older than its own have fails there (MethodRemovedError, unrun).
  Otherwise callers of a removed method and of a new one, alternating, would
  move the grain back and forth, one activation per call; this way a grain
  has at most one activation per version hosted (while none is collected or
  lost), and calls that need a newer version stay on it.

So in a rolling upgrade new activations go to the new silos as soon as they
are active, the old ones keep what they have until they drain, and a call of
a method only the new version has moves its grain over. A rollback (the newer
silos gone) leaves the older version the newest again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from silo.records.membership import MemberRow


def compatible(
    rows: Iterable[MemberRow], type_name: str, versions: Mapping[int, frozenset[str]], method: str | None
) -> list[MemberRow]:
    """The rows hosting the newest version whose method list has ``method`` (None: any method).

    A row whose version is missing from ``versions`` (its manifest not read yet)
    counts only when ``method`` is None.
    """
    fit = [
        r for r in rows if method is None or method in versions.get(r.version_of(type_name), ())
    ]
    if not fit:
        return []
    newest = max(r.version_of(type_name) for r in fit)
    return [r for r in fit if r.version_of(type_name) == newest]


def unknown_versions(rows: Iterable[MemberRow], type_name: str, versions: Mapping[int, frozenset[str]]) -> set[int]:
    """Versions some row hosts whose manifest is not in ``versions`` (time to read them again)."""
    return {r.version_of(type_name) for r in rows} - set(versions)
