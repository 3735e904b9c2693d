"""method="auto", the default: the target's own head where one is found for it, else the draft
model. Decided once, when the engine is built, from what exists:

    draft=... named                                    -> "draft"  (the user chose the model)
    a head for this target, found with no draft=:      -> "eagle"
      one `understudy train-head` wrote into the cache,
      or the package's own, trained on this very file
    otherwise                                          -> "draft"

Why the head first (measured in docs/eagle.md): on a 2-core Zen 4 the packaged head ran
ahead of the 0.5B draft model or level with it in every bench run over completion, chat and
editing prompts, far ahead on editing, behind on completion and chat; and it holds no second
model's weights nor prefills every prompt a second time. An engine that learnt to choose
between the two, per round or per request, lost to the head alone (docs/history.md).
Under either method a round that does not pay drafts nothing (automatic K's K = 0): the
engine then decodes plainly.

The head is found by the target's name, as `find_head` (drafters/eagle.py) would find it:
the package's head by the packaged model's registered sha256, so a packaged target named by
its file's path gets the draft model (hashing every .gguf a user names, at every build,
would cost about a second a GB).
"""

from __future__ import annotations

from understudy.config import BuiltMethod, Method, UnderstudyError
from understudy.drafters.eagle import default_head_dir
from understudy.models.eagle_head import CONFIG_FILE
from understudy.models.head_file import read_packed, shipped_head
from understudy.models.registry import DEFAULT_TARGET, resolve_packaged


def head_for(target: str) -> str | None:
    """Where method eagle finds a head for `target` with no draft= ("the cache" or "the
    package"), by name alone (module docstring); None when it would find none."""
    if (default_head_dir(target) / CONFIG_FILE).exists():
        return "the cache"
    packaged, shipped = resolve_packaged(target), shipped_head()
    if packaged is None or not shipped.is_file():
        return None
    try:
        _, sha256, _ = read_packed(shipped)
    except UnderstudyError:
        return None
    return "the package" if sha256 == packaged.sha256 else None


def resolve_method(
    method: Method, target: str | None, draft: str | None
) -> tuple[BuiltMethod, str]:
    """(the method to build, why): `method` itself unless it is "auto" (module docstring)."""
    if method != "auto":
        return method, "asked for"
    if draft is not None:
        return "draft", "a draft model was named"
    where = head_for(target or DEFAULT_TARGET)
    if where is not None:
        return "eagle", f"the target's own head, from {where}"
    return "draft", "no trained head for this target"
