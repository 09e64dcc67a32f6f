"""What the everyday tier's tests reach, read from their source (tests/test_tiers.py holds `make test`
to it): the modules of this project that its tests import, and the functions of modules they use,
among them the console scripts' own.

Read, not run, so that it holds whatever part of the suite a run selects. A test uses what its body
names (a module, a name imported from one, a module's name as a string: importlib's, mock.patch's,
run_module's, which runs its main), and what the functions, fixtures and constants it names use in
turn: in its file, in conftest.py and in the helper modules. A module used brings in its packages
and what it imports as it loads. What only tests marked slow use is not reached: a test module's
imports count where a test of the tier uses them, not for being at its top."""

import ast
import os
import re

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
PACKAGES = ("fairseq_feedback", "fairseq_feedback_cli")


def project_modules() -> dict:
    """{dotted name: path} of every module of the packages."""
    modules = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    modules[dotted.removesuffix(".__init__")] = path
    return modules


def console_scripts() -> dict:
    """{script: (module, function)} of setup.py's entry points."""
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    (scripts,) = [node.values[node.keys.index(key)] for node in ast.walk(tree) if isinstance(node, ast.Dict)
                  for key in node.keys if isinstance(key, ast.Constant) and key.value == "console_scripts"]
    entries = [re.fullmatch(r"\s*(\S+)\s*=\s*(\S+):(\S+)\s*", element.value).groups() for element in scripts.elts]
    return {script: (module, function) for script, module, function in entries}


class Reach:
    """What the tests of `tests` not marked slow reach: .modules, the project's modules imported;
    .functions, (module, name) of each name of a module used ((module, None): the module itself)."""

    def __init__(self, tests=TESTS):
        self.project = project_modules()
        # this file names the packages (PACKAGES) without using them
        self.files = {name[:-3]: _File(os.path.join(tests, name), self.project) for name in os.listdir(tests)
                      if name.endswith(".py") and name != os.path.basename(__file__)}
        used, reached = _Uses(), set()
        todo = [(name, test) for name, file in self.files.items() for test in file.everyday_tests()]
        while todo:
            node = todo.pop()
            if node in reached:
                continue
            reached.add(node)
            name, top = node
            file = self.files[name]
            if top not in file.uses:  # a name the helper module imports
                file.resolve(file.bindings.get(top), [], used)
                continue
            uses = file.uses[top]
            used.objects |= uses.objects
            todo += [(name, "<module>")] + [(name, n) for n in uses.names if n in file.uses]
            todo += [(helper, n) for helper, n in uses.helpers if helper in self.files]
            if "conftest" in self.files:  # the fixtures it asks for
                todo += [("conftest", n) for n in uses.names if n in self.files["conftest"].uses]
        self.functions = used.objects
        self.modules = _imported_as_they_load({module for module, _ in used.objects}, self.project)


class _Uses:
    def __init__(self):
        self.names, self.objects, self.helpers = set(), set(), set()


class _File:
    """A file of tests/: what each top-level function, class or assignment uses, by its name, and
    "<module>", what the file's other statements use as it loads."""

    def __init__(self, path, project):
        self.tree, self.project = ast.parse(open(path).read()), project
        # each name the file imports: ("module", dotted), ("object", module, name), ("helper", file) or
        # ("helper-object", file, name) (a helper module's, or a library's, which is not in `files`)
        self.bindings = {}
        self.uses = {"<module>": _Uses()}
        for statement in self.tree.body:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                self.bind(statement, self.bindings)
            elif isinstance(statement, (ast.FunctionDef, ast.ClassDef)):
                self.uses[statement.name] = self.read(statement)
            elif isinstance(statement, ast.Assign) and all(isinstance(t, ast.Name) for t in statement.targets):
                for target in statement.targets:
                    self.uses[target.id] = self.read(statement)
            else:
                self.read(statement, self.uses["<module>"])

    def everyday_tests(self) -> list:
        if any(isinstance(s, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in s.targets)
               and _is_slow(s.value) for s in self.tree.body):
            return []
        return [s.name for s in self.tree.body if isinstance(s, ast.FunctionDef) and s.name.startswith("test_")
                and not any(_is_slow(d) for d in s.decorator_list)]

    def bind(self, statement, bindings):
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                name = alias.name if alias.asname else alias.name.split(".")[0]  # import a.b binds a
                bindings[alias.asname or name] = ("module" if name.split(".")[0] in PACKAGES else "helper", name)
        elif statement.level == 0:
            for alias in statement.names:
                within = f"{statement.module}.{alias.name}"
                bindings[alias.asname or alias.name] = (
                    ("module", within) if within in self.project else
                    ("object", statement.module, alias.name) if statement.module.split(".")[0] in PACKAGES else
                    ("helper-object", statement.module, alias.name))

    def read(self, node, uses=None) -> _Uses:
        uses = uses or _Uses()
        bindings = dict(self.bindings)
        for inner in ast.walk(node):
            if isinstance(inner, (ast.Import, ast.ImportFrom)):
                self.bind(inner, bindings)
        for inner in ast.walk(node):
            if isinstance(inner, ast.arg):
                uses.names.add(inner.arg)  # a fixture it asks for
            elif isinstance(inner, ast.Name):
                uses.names.add(inner.id)
                self.resolve(bindings.get(inner.id), [], uses)
            elif isinstance(inner, ast.Attribute):
                chain, base = _chain(inner)
                self.resolve(bindings.get(base), chain, uses)
            elif isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                module, _, name = inner.value.rpartition(".")
                if inner.value in self.project:
                    uses.objects.add((inner.value, None))
                elif module in self.project:
                    uses.objects.add((module, name))
            if isinstance(inner, ast.Call) and _chain(inner.func) in (([], "run_module"), (["run_module"], "helpers")) \
                    and inner.args and isinstance(inner.args[0], ast.Constant) and inner.args[0].value in self.project:
                uses.objects.add((inner.args[0].value, "main"))  # helpers.run_module runs the module's main
        return uses

    def resolve(self, binding, chain, uses):
        """What a name bound to `binding` names, followed by the attributes `chain`."""
        if binding is None:
            return
        kind, *what = binding
        if kind == "helper" and chain:
            uses.helpers.add((what[0], chain[0]))
        elif kind == "helper-object":
            uses.helpers.add(tuple(what))
        elif kind == "object":
            uses.objects.add(tuple(what))
        elif kind == "module":
            module = what[0]
            for attribute in chain:
                if f"{module}.{attribute}" not in self.project:
                    uses.objects.add((module, attribute))
                    return
                module = f"{module}.{attribute}"
            uses.objects.add((module, None))


def _chain(node):
    """(attributes, base name) of a.b.c: (["b", "c"], "a"); base None where it is no plain name (f().b)."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.insert(0, node.attr)
        node = node.value
    return chain, node.id if isinstance(node, ast.Name) else None


def _is_slow(expression) -> bool:
    """pytest.mark.slow itself, or in a list of marks; not a parameter's mark (the test's other cases run)."""
    if isinstance(expression, (ast.List, ast.Tuple)):
        return any(_is_slow(e) for e in expression.elts)
    return _chain(expression) == (["mark", "slow"], "pytest")


def _imported_as_they_load(modules, project) -> set:
    """`modules`, their packages and what each imports at its top level (not in a function, which
    imports only where it runs), until nothing more."""
    found, todo = set(), [m for m in modules if m in project]
    while todo:
        module = todo.pop()
        if module in found:
            continue
        found.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        package = parts if project[module].endswith("__init__.py") else parts[:-1]
        for statement in _top_level(ast.parse(open(project[module]).read())):
            if isinstance(statement, ast.Import):
                todo += [a.name for a in statement.names if a.name in project]
            elif isinstance(statement, ast.ImportFrom):
                base = ".".join([*package[:len(package) - statement.level + 1], statement.module or ""]).strip(".") \
                    if statement.level else statement.module
                todo += [m for m in [base, *(f"{base}.{a.name}" for a in statement.names)] if m in project]
    return found


def _top_level(tree):
    """The statements that run as a module loads: its body, into if, try, with and class, not into functions."""
    todo = list(tree.body)
    while todo:
        statement = todo.pop()
        yield statement
        if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo += [child for child in ast.iter_child_nodes(statement) if isinstance(child, ast.stmt)]
