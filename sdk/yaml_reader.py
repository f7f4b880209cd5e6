"""The strict YAML reading of profiles and deploy inventories: PyYAML's safe loader with duplicate keys refused and
every error one line naming `file:line:column` (colibri_sdk.profile, colibri_sdk.deploy.inventory)."""

from __future__ import annotations

from .errors import ProfileError


class _MarkedProfileError(ProfileError):
    """A loader fault at a known place: `parse_yaml` prefixes `file:line:column`."""

    def __init__(self, message: str, mark):
        super().__init__(message)
        self.mark = mark


def _strict_loader():
    """PyYAML's SafeLoader, refusing duplicate keys (plain safe_load keeps the last one silently).

    Merge keys (`<<: *base`, YAML 1.1's merge type, which SafeLoader implements in `flatten_mapping`) are
    supported: keys written in the mapping itself override merged ones, as the merge type specifies; a key written
    twice in the mapping itself is a duplicate.
    """
    import yaml

    class StrictLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<`: SafeLoader.construct_mapping merges it (flatten_mapping)
            key = loader.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                hash(key)
            except TypeError:
                raise _MarkedProfileError(
                    f"the key at line {line} is a {type(key).__name__}; allowed: a plain scalar key", key_node.start_mark
                ) from None
            if key in seen:
                raise _MarkedProfileError(
                    f"duplicate key {key!r} at line {line} (first at line {seen[key] + 1}); allowed: each key once",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return StrictLoader


def _at(source: str, mark) -> str:
    """`file:line:column` (both 1-based, as compilers print them) of a PyYAML mark, or just `file`."""
    return f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source


def _yaml_message(exc) -> str:
    """PyYAML's error as one line: the problem and its context, without the caret snippet."""
    parts = [getattr(exc, "context", None), getattr(exc, "problem", None)]
    text = "; ".join(" ".join(str(p).split()) for p in parts if p) or " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def parse_yaml(text: str, source: str) -> dict:
    """YAML text → dict with the safe loader (merge keys supported, duplicate keys refused).

    Raises:
        ProfileError: one line, `file:line:column: not valid YAML: <problem>` (or `file: ...` where PyYAML gives no
            position): syntax errors, duplicate or unhashable keys, unknown tags, huge integers, deep nesting.
    """
    import yaml

    try:
        data = yaml.load(text, Loader=_strict_loader())  # a SafeLoader subclass: no arbitrary objects
    except _MarkedProfileError as exc:
        raise ProfileError(f"{_at(source, exc.mark)}: {exc}") from None
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise ProfileError(f"{_at(source, mark)}: not valid YAML: {_yaml_message(exc)}") from None
    except yaml.YAMLError as exc:
        raise ProfileError(f"{source}: not valid YAML: {_yaml_message(exc)}") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise ProfileError(f"{source}: not valid YAML: {' '.join(str(exc).split())[:120]}") from None
    except RecursionError:
        raise ProfileError(f"{source}: not valid YAML: nested too deeply") from None
    return data
