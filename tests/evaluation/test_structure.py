"""The house rules of the code's structure, read from the source (no imports run): a module never imports
from a layer above its own (docs/design.md, "Layers"), the modules' top-level imports have no cycle, no
test module imports another test module or a conftest (shared test code lives in helper modules of tests/),
modules and functions fit a page (500 and 80 lines), and capabilities are declared, never probed (`hasattr`,
`isinstance` on a model class, another module's attribute set at run time) outside documented adapters."""

import ast
import pathlib
import re

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "specdec"
# docs/design.md's layers; `from specdec import sampling` names a core module (specdec/__init__.py).
LAYERS = {"core": 1, "models": 2, "decoding": 3, "data": 4, "training": 4, "evaluation": 5, "cli": 6}
CORE_NAMES = ("checks", "rng", "sampling", "spectr", "targets", "theory", "tree", "verify")


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(REPO_ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, *, top_level_only: bool) -> list[tuple[str, int]]:
  """The modules a file imports (absolute names, `from a import b` as a.b where b may be a module), with
  line numbers; `top_level_only`: not those inside functions."""
  tree = ast.parse(path.read_text(), str(path))
  nodes = tree.body if top_level_only else list(ast.walk(tree))
  found = []
  for node in nodes:
    if isinstance(node, ast.Import):
      found += [(alias.name, node.lineno) for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
  return found


def _layer(module: str) -> int | None:
  parts = module.split(".")
  if parts[0] != "specdec" or len(parts) < 2:
    return None
  return 1 if parts[1] in CORE_NAMES else LAYERS.get(parts[1])


def test_no_module_imports_from_a_higher_layer():
  problems = []
  for path in sorted(PACKAGE.rglob("*.py")):
    own = _layer(_module_name(path))
    for target, line in _imports(path, top_level_only=False):
      layer = _layer(target)
      if own is not None and layer is not None and layer > own:
        problems.append(f"{path.relative_to(REPO_ROOT)}:{line} (layer {own}) imports {target} (layer {layer})")
  assert not problems, "\n".join(problems)


def test_top_level_imports_have_no_cycle():
  modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}

  def resolve(name: str) -> str | None:   # `from specdec.x import y`: the module y, else x
    parts = name.split(".")
    if parts[:1] == ["specdec"] and len(parts) > 1 and parts[1] in CORE_NAMES:   # `from specdec import sampling`
      name = ".".join(["specdec", "core", *parts[1:]])
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name or None

  edges = {module: {target for name, _ in _imports(path, top_level_only=True)
                    if (target := resolve(name)) and target != module and target != "specdec"}
           for module, path in modules.items()}
  state: dict[str, str] = {}

  def visit(module: str, stack: list[str]) -> None:
    state[module] = "open"
    for target in sorted(edges[module]):
      if state.get(target) == "open":
        cycle = stack[stack.index(target):] + [target] if target in stack else [module, target]
        raise AssertionError("import cycle: " + " -> ".join(cycle))
      if target not in state:
        visit(target, stack + [target])
    state[module] = "done"

  for module in sorted(edges):
    if module not in state:
      visit(module, [module])


PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
IMPORT_LINE = re.compile(r"^[ \t]*(?:from[ \t]+([\w.]+)[ \t]+import[ \t]+(\([^)]*\)|[\w \t,]+)|import[ \t]+([\w.]+))",
                         re.MULTILINE)


def _doc_imports(page: pathlib.Path) -> list[tuple[str, int]]:
  """`_imports` of the Python blocks of a docs page, read line by line (a block may hold an elision, …)."""
  text, found = page.read_text(), []
  for block in PYTHON_BLOCK.finditer(text):
    for match in IMPORT_LINE.finditer(text, block.start(1), block.end(1)):
      module, names, plain = match.groups()
      line = text.count("\n", 0, match.start()) + 1
      found += [(plain, line)] if plain else [(f"{module}.{name.split()[0]}", line)
                                              for name in names.strip("()").split(",") if name.strip()]
  return found


def test_core_modules_have_one_import_path():
  """A core module is imported from the package, `from specdec import sampling` (specdec/__init__.py re-exports
  them: the documented API), never as specdec.core.sampling (`from specdec.core import sampling`, `from
  specdec.core.sampling import …`, `import specdec.core.sampling`): in specdec/, tests/, scripts/ and the
  Python blocks of the docs. specdec.core's private modules (`_top_p`) have one path, specdec.core's."""
  files = [path for folder in ("specdec", "tests", "scripts") for path in sorted((REPO_ROOT / folder).rglob("*.py"))]
  pages = sorted((REPO_ROOT / "docs").rglob("*.md")) + [REPO_ROOT / "README.md"]
  problems = []
  for path in files + pages:
    if path == PACKAGE / "__init__.py":   # the re-exports themselves
      continue
    imports = _doc_imports(path) if path.suffix == ".md" else _imports(path, top_level_only=False)
    problems += [f"{path.relative_to(REPO_ROOT)}:{line} imports {name}; use `from specdec import {parts[2]}`"
                 for name, line in imports
                 if (parts := name.split("."))[:2] == ["specdec", "core"] and len(parts) > 2
                 and parts[2] in CORE_NAMES]
  assert not problems, "\n".join(problems)


def test_no_test_module_imports_another_test_module_or_a_conftest():
  problems = []
  for path in sorted((REPO_ROOT / "tests").rglob("*.py")):
    for target, line in _imports(path, top_level_only=False):
      parts = target.split(".")
      if parts[0] == "tests" and any(part.startswith("test_") or part == "conftest" for part in parts[1:]):
        problems.append(f"{path.relative_to(REPO_ROOT)}:{line} imports {target}")
  assert not problems, "\n".join(problems)


def test_no_target_rule_name_is_compared_outside_core():
  """Target rules are records (`targets.Rule`): outside core no code compares a rule's name with a literal
  (`rule == "spec"`, `rule in ("chow", …)`, `rule.startswith("lossy")`), so a new rule needs no change there."""
  names = ("spec", "lossy", "lossy_tuned", "bild", "chow", "chow_log", "diff", "diff_log", "opt", "opt_log",
           "token_v1", "token_v2", "token_v3")

  def literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
      return [value for element in node.elts for value in literals(element)]
    return []

  problems = []
  for path in sorted(PACKAGE.rglob("*.py")):
    if path.relative_to(PACKAGE).parts[0] == "core":
      continue
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      found = []
      if isinstance(node, ast.Compare):
        found = [s for operand in [node.left, *node.comparators] for s in literals(operand) if s in names]
      elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")):
        found = [s for arg in node.args for s in literals(arg) if any(name.startswith(s) for name in names)]
      problems += [f"{path.relative_to(REPO_ROOT)}:{node.lineno} compares {s!r}" for s in found]
  assert not problems, "\n".join(problems)


def _registered_families() -> dict[str, str]:
  """{family name: its module's name} of the `ModelFamily(...)` records in specdec/models/families.py."""
  tree = ast.parse((PACKAGE / "models" / "families.py").read_text())
  found = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ModelFamily":
      module = next(k.value.id for k in node.keywords if k.arg == "module")
      found[node.args[0].value] = module
  return found


def test_model_families_are_listed_in_their_registry_only():
  """Model families are records (`models.families`): no other module lists two families, by name (a literal
  collection or comparison naming two) or by their modules (reading two families' PRESETS, config or SWITCHES),
  so adding a family is its record, its module and its tests."""
  registered = _registered_families()
  assert {"transformer", "t5", "gemma2", "llama"} <= set(registered), registered
  modules = set(registered.values())

  def names(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in registered:
      return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
      return {name for element in node.elts for name in names(element)}
    return set()

  problems = []
  for path in sorted([*PACKAGE.rglob("*.py"), *(REPO_ROOT / "scripts").rglob("*.py")]):
    if path == PACKAGE / "models" / "families.py":
      continue
    tree = ast.parse(path.read_text(), str(path))
    members = {(node.value.id, node.attr) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
               and isinstance(node.value, ast.Name) and node.value.id in modules
               and node.attr in ("PRESETS", "config", "SWITCHES", "DEFAULTS")}
    if len({module for module, _ in members}) > 1:
      problems.append(f"{path.relative_to(REPO_ROOT)} reads {sorted(members)}")
    for node in ast.walk(tree):
      if isinstance(node, ast.Dict):
        listed = {name for key in node.keys if key is not None for name in names(key)}
      elif isinstance(node, ast.Compare):
        listed = {name for operand in [node.left, *node.comparators] for name in names(operand)}
      else:
        listed = names(node)
      if len(listed) > 1:
        problems.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} lists families {sorted(listed)}")
  assert not problems, "\n".join(problems)


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 80
# Modules and functions over the bounds that are still to be split, each (path under the repository, the
# function's name or None for the module). The list can only shrink: an entry within its bound fails the test.
NOT_YET_SPLIT: tuple[tuple[str, str | None], ...] = ()


def _oversized() -> set[tuple[str, str | None, int]]:
  """(path, function name or None for the module, lines) of every module over MAX_MODULE_LINES and every
  function (methods and nested functions too, from its `def` line to its last) over MAX_FUNCTION_LINES."""
  found = set()
  for path in sorted(PACKAGE.rglob("*.py")):
    text = path.read_text()
    name = path.relative_to(REPO_ROOT).as_posix()
    if len(text.splitlines()) > MAX_MODULE_LINES:
      found.add((name, None, len(text.splitlines())))
    for node in ast.walk(ast.parse(text, str(path))):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
          found.add((name, node.name, lines))
  return found


def test_modules_and_functions_fit_a_page():
  """No module over 500 lines and no function over 80 (read whole, a module is a few pages and a function one),
  but those NOT_YET_SPLIT lists, which must still exceed their bound (so that the list only shrinks)."""
  found = _oversized()
  excused = set(NOT_YET_SPLIT)

  def what(function: str | None) -> str:
    return "the module" if function is None else f"{function}()"

  problems = [f"{path}: {what(function)} has {lines} lines (at most "
              f"{MAX_MODULE_LINES if function is None else MAX_FUNCTION_LINES})"
              for path, function, lines in sorted(found, key=lambda f: (f[0], f[1] or ""))
              if (path, function) not in excused]
  over = {(path, function) for path, function, _ in found}
  problems += [f"{path}: {what(function)} is within its bound now: remove it from NOT_YET_SPLIT"
               for path, function in NOT_YET_SPLIT if (path, function) not in over]
  assert not problems, "\n".join(problems)



# The classes behind `models.base.Model`: a consumer reads a model's declared capabilities, never its class.
MODEL_CLASSES = ("Configured", "DecoderOnly", "Decoder", "T5", "TransformerLM")
# The documented adapters at a boundary, (path, function, what it may do: "hasattr", "isinstance" on a model
# class, "assigns" an attribute of an imported module). The list can only shrink: an entry that excuses
# nothing fails the test.
ADAPTERS = (
    ("specdec/evaluation/bench.py", "_encoder_decoder", "hasattr"),       # `--before`: revisions before the field
    ("specdec/cli/bench/program.py", "compiled_generate", "hasattr"),     # `--before`: revisions before `lower`
    ("specdec/cli/__init__.py", "_watch_for_interrupts", "assigns"),      # sys.unraisablehook, the interpreter's hook
    ("specdec/cli/__init__.py", "run", "assigns"),                        # sys.argv less --debug, for mains reading it
    ("scripts/compile_imports.py", "main", "assigns"),                    # sys.dont_write_bytecode: the cache it warms
)


def _probes(path: pathlib.Path) -> list[tuple[tuple[str, ...], int, str, str]]:
  """(enclosing functions, line, kind, code) of each `hasattr` call, `isinstance` test on a model class, and
  assignment (or `setattr`) to an attribute of an imported module or name in the file at `path`."""
  tree = ast.parse(path.read_text(), str(path))
  imported = {alias.asname or alias.name.partition(".")[0] for node in ast.walk(tree)
              if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}

  def root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
      node = node.value
    return node.id if isinstance(node, ast.Name) else None

  def found(node: ast.AST) -> tuple[str, ast.AST] | None:
    targets = {ast.Assign: lambda: node.targets, ast.AugAssign: lambda: [node.target],
               ast.AnnAssign: lambda: [node.target]}.get(type(node), list)()
    targets = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
    assigned = [t for t in targets if isinstance(t, ast.Attribute) and root(t) in imported]
    if assigned:
      return "assigns", assigned[0]
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
      return None
    if node.func.id == "hasattr":
      return "hasattr", node
    if node.func.id == "setattr" and node.args and root(node.args[0]) in imported:
      return "assigns", node
    if node.func.id == "isinstance" and len(node.args) == 2:
      classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
      if any(getattr(c, "id", getattr(c, "attr", None)) in MODEL_CLASSES for c in classes):
        return "isinstance", node
    return None

  probes = []

  def visit(node: ast.AST, functions: tuple[str, ...]) -> None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      functions += (node.name,)
    if (probe := found(node)) is not None:
      probes.append((functions, node.lineno, probe[0], ast.unparse(probe[1])))
    for child in ast.iter_child_nodes(node):
      visit(child, functions)
  visit(tree, ())
  return probes


def test_capabilities_are_declared_not_probed():
  """What a consumer needs of a model or drafter is a declared field or method of its protocol
  (`models.base.Model`, `decoding.drafters.Drafter`): in specdec/ and scripts/ no `hasattr`, no `isinstance`
  on a model class and no imported module's attribute set at run time, but in the ADAPTERS at a boundary."""
  problems, used = [], set()
  for path in sorted([*PACKAGE.rglob("*.py"), *(REPO_ROOT / "scripts").rglob("*.py")]):
    name = path.relative_to(REPO_ROOT).as_posix()
    for functions, line, kind, code in _probes(path):
      excused = {(name, function, kind) for function in functions} & set(ADAPTERS)
      used |= excused
      if not excused:
        problems.append(f"{name}:{line} ({'.'.join(functions) or 'module'}) {kind}: {code}")
  problems += [f"{path}: {function}() has no {kind} to excuse now: remove it from ADAPTERS"
               for path, function, kind in ADAPTERS if (path, function, kind) not in used]
  assert not problems, "\n".join(problems)
