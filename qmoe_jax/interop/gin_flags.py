"""T5X's gin command line: ``--gin_file``, ``--gin_bindings``, ``--gin.NAME=VALUE``,
``--gin_search_paths``.

As in ``t5x/gin_utils.py``: ``--gin.NAME=VALUE`` is rewritten to the binding
``NAME = VALUE``; files are looked up in the search paths (``--gin_search_paths``,
a comma list, default ``.``, then the package's own ``qmoe_jax/configs/``); files
are parsed first, in order, then the bindings, so the command line wins. Gin's
errors come back as one-line ``ValueError``s that name the file and line, the
binding, or the macro at fault.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re

import gin

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
_INCLUDE = re.compile(r"""^\s*include\s+['"]([^'"]+)['"]""")
_REQUIRED = re.compile(r"^(\w+)/macro\.value set to `%gin\.REQUIRED`")
_UNDEFINED = re.compile(r"No bindings specified for '(\w+)/gin\.macro'")
_MACRO_BINDING = re.compile(r"^([A-Za-z_]\w*)\s*=")


class GinConfigError(ValueError):
    """A gin file or binding that cannot be used; the message names the file, line or flag."""


def rewrite_gin_args(argv: list[str]) -> list[str]:
    """``--gin.NAME=VALUE`` -> ``--gin_bindings=NAME = VALUE`` (T5X's ``rewrite_gin_args``)."""
    out = []
    for arg in argv:
        if arg.startswith("--gin."):
            if "=" not in arg:
                raise GinConfigError(f"gin bindings must look like --gin.NAME=VALUE, got {arg!r}")
            name, value = arg[len("--gin.") :].split("=", 1)
            arg = f"--gin_bindings={name} = {value}"
        out.append(arg)
    return out


def uses_gin(argv: list[str]) -> bool:
    """Whether the command line asks for gin mode (any ``--gin_file``)."""
    return any(arg == "--gin_file" or arg.startswith("--gin_file=") for arg in argv)


def add_gin_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gin_file",
        action="append",
        required=True,
        help="gin file, repeatable; parsed in order (searched in --gin_search_paths, then "
        "qmoe_jax/configs/)",
    )
    parser.add_argument(
        "--gin_bindings",
        action="append",
        default=[],
        help="a gin binding, repeatable, applied after the files; --gin.NAME=VALUE is the same "
        "as --gin_bindings='NAME = VALUE'",
    )
    parser.add_argument(
        "--gin_search_paths",
        default=".",
        help="comma-separated folders to look up --gin_file and include paths in (default: .); "
        "the package's configs folder is always searched last",
    )


@dataclasses.dataclass(frozen=True)
class GinSource:
    """One line of gin text: where it is (``file:line`` or the flag) and the text."""

    where: str
    text: str


@dataclasses.dataclass(frozen=True)
class ParsedGin:
    """What was parsed, in parse order, for naming the place a macro or configurable was set."""

    files: tuple[str, ...]
    lines: tuple[GinSource, ...]

    def where_set(self, name: str) -> str | None:
        """Where the macro ``name`` was last given a value (``file:line`` or ``--gin.NAME``), or
        None."""
        found = None
        for line in self.lines:
            match = _MACRO_BINDING.match(line.text)
            if match and match.group(1) == name:
                found = line.where
        return found

    def files_mentioning(self, pattern: str) -> list[str]:
        """Files (with includes) any of whose lines match the regex ``pattern``, in parse order."""
        regex = re.compile(pattern)
        out = []
        for line in self.lines:
            path = line.where.rsplit(":", 1)[0]
            if regex.search(line.text) and not line.where.startswith("--") and path not in out:
                out.append(path)
        return out


def search_paths(value: str) -> list[str]:
    """The folders gin files are looked up in: ``value`` (a comma list) then the package's
    configs."""
    return [path for path in value.split(",") if path] + [CONFIGS_DIR]


def find_gin_file(name: str, paths: list[str]) -> str:
    """The first existing ``<path>/<name>`` (or ``name`` itself if absolute); ``GinConfigError`` if
    none."""
    candidates = [name] if os.path.isabs(name) else [os.path.join(path, name) for path in paths]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    raise GinConfigError(
        f"gin file {name!r} not found (looked in {', '.join(paths)}); check the name, or add "
        "its folder to --gin_search_paths"
    )


def _lines(path: str, paths: list[str], seen: tuple[str, ...] = ()) -> list[GinSource]:
    if path in seen:
        raise GinConfigError(f"gin file {path} includes itself (through {' -> '.join(seen)})")
    with open(path, encoding="utf-8") as f:
        text = f.read().splitlines()
    out = []
    for number, line in enumerate(text, start=1):
        include = _INCLUDE.match(line)
        if include:
            try:
                out.extend(_lines(find_gin_file(include.group(1), paths), paths, seen + (path,)))
            except GinConfigError as error:
                raise GinConfigError(f"{path}:{number}: {error}") from None
        out.append(GinSource(f"{path}:{number}", line))
    return out


def _set_search_paths(paths: list[str]) -> None:
    """Makes ``paths`` gin's include search paths, dropping any that another parse in this process
    added (gin only appends, and would look in a stale folder first)."""
    prefixes = getattr(gin.config, "_LOCATION_PREFIXES", None)
    if isinstance(prefixes, list):
        del prefixes[1:]  # keep gin's own '' (paths as given)
    for path in paths:
        gin.add_config_file_search_path(path)


@contextlib.contextmanager
def _quiet_root_logger():
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _one_line(error: Exception) -> str:
    return "; ".join(part.strip() for part in str(error).splitlines() if part.strip())


def parse_gin(gin_files: list[str], bindings: list[str], search_path_list: str = ".") -> ParsedGin:
    """Clears gin, then parses ``gin_files`` (looked up in the search paths) and ``bindings`` in
    that order.

    Raises ``GinConfigError`` naming the file and line or the binding: an
    unknown configurable or parameter, a syntax error, an undefined macro, a
    ``%gin.REQUIRED`` macro left unset, or a ``--gin.NAME`` macro that no file
    uses.
    """
    paths = search_paths(search_path_list)
    files = [find_gin_file(name, paths) for name in gin_files]
    lines = [line for path in files for line in _lines(path, paths)]
    lines += [
        GinSource(
            f"--gin.{_MACRO_BINDING.match(b).group(1)}"
            if _MACRO_BINDING.match(b)
            else f"--gin_bindings={b!r}",
            b,
        )
        for b in bindings
    ]
    parsed = ParsedGin(tuple(files), tuple(lines))
    gin.clear_config()
    _set_search_paths(paths)
    try:
        with (
            _quiet_root_logger()
        ):  # gin logs "Path not found" for every search path it tries before the right one
            gin.parse_config_files_and_bindings(files, bindings)
    except ValueError as error:
        message = str(error)
        required = _REQUIRED.match(message)
        if required:
            name = required.group(1)
            raise GinConfigError(
                f"missing required gin macro {name} (declared required at "
                f"{parsed.where_set(name)}); set it, e.g. --gin.{name}=..."
            ) from None
        undefined = _UNDEFINED.search(message)
        if undefined:
            name = undefined.group(1)
            used = [line.where for line in lines if re.search(rf"%{name}\b", line.text)]
            fix = (
                "add a model gin file, e.g. --gin_file=models/switch_base_8.gin"
                if name == "MODEL"
                else f"define it (--gin.{name}=...) or fix the name"
            )
            raise GinConfigError(
                f"unknown gin macro %{name}, used at {', '.join(used) or 'a binding'} but never "
                f"defined; {fix}"
            ) from None
        raise GinConfigError(f"gin: {_one_line(error)}") from None
    except (
        Exception
    ) as error:  # gin's parser raises SyntaxError, tokenize errors and others on malformed text
        raise GinConfigError(
            f"cannot parse the gin config ({', '.join(files)} and {len(bindings)} binding(s)): "
            f"{type(error).__name__}: {_one_line(error)}"
        ) from None
    _check_command_line_macros(parsed)
    return parsed


def _check_command_line_macros(parsed: ParsedGin) -> None:
    """A macro set on the command line must be one the parsed files use (else it is a typo that does
    nothing)."""
    used = {name for line in parsed.lines for name in re.findall(r"%([A-Za-z_]\w*)", line.text)}
    for line in parsed.lines:
        match = _MACRO_BINDING.match(line.text)
        if (
            line.where.startswith("--")
            and match
            and "." not in match.group(1)
            and match.group(1) not in used
        ):
            name = match.group(1)
            known = sorted(
                {
                    m.group(1)
                    for ln in parsed.lines
                    if not ln.where.startswith("--")
                    for m in [_MACRO_BINDING.match(ln.text)]
                    if m and m.group(1) in used
                }
            )
            raise GinConfigError(
                f"unknown gin macro {name} ({line.where}): none of {', '.join(parsed.files)} "
                f"uses %{name}; known macros: {', '.join(known)}"
            )
