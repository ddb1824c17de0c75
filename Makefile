# The two commands of the README: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PLUGINS := $(sort $(dir $(wildcard plugins/*/pyproject.toml)))
# Each built-in plugin's one module, plugins/<name>/kibotos_<name>, for mypy.
PLUGIN_MODULES := $(foreach p,$(PLUGINS),$(p)kibotos_$(notdir $(p:/=)))

.PHONY: venv demo test test-fast lint clean deb envd-protos e2b-js-sdk

$(BIN)/.installed: pyproject.toml $(wildcard plugins/*/pyproject.toml)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]' $(foreach p,$(PLUGINS),-e $(p))
	touch $@

venv: $(BIN)/.installed

# Sets up this machine (apt packages, the venv) and runs the main job: a local cluster
# under .dev-cluster/, its nodes READY, left running.  demo.sh builds the venv itself,
# after the apt packages the venv needs.
demo:
	./packaging/demo.sh

# The test command of the README and of CI: lint, types, and every test.
test: venv
	$(BIN)/ruff check kibotos plugins tests bench
	$(BIN)/mypy
	$(BIN)/mypy --strict $(PLUGIN_MODULES)
	$(BIN)/python -m pytest -p no:cacheprovider

# The inner loop: skip the slow end-to-end tests.
test-fast: venv
	$(BIN)/python -m pytest -m 'not slow' -x -q

# The E2B gateway's envd messages, from the .proto files beside them (protoc from
# grpcio-tools, a dev dependency); the generated modules are committed.
ENVD_PB := kibotos/gateway/e2b/third_party/envd
envd-protos: venv
	cd $(ENVD_PB) && $(abspath $(BIN))/python -m grpc_tools.protoc -I. --python_out=. \
		--pyi_out=. process.proto filesystem.proto

# The E2B JavaScript SDK for tests/gateway/test_e2b_js_sdk.py, installed by npm into the
# test cache (tests never fetch anything themselves).
E2B_JS := $(or $(KIBOTOS_TEST_CACHE),/var/cache/kibotos-test)/e2b-js
e2b-js-sdk:
	mkdir -p $(E2B_JS) && cd $(E2B_JS) && npm install --no-audit --no-fund --no-save e2b@2.51.0

# The Debian package, from a clean copy of HEAD, into dist/ (docs/packaging.md).
deb:
	./packaging/deb/build.sh --out dist

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
