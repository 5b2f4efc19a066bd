// Build-only module for cnitool, libcni's own driver (chaining, prevResult, CHECK, the result
// cache, CAP_ARGS), at a libcni release that speaks CNI spec 1.1.0. Built by tests/env/tools.sh.
module kuryr-rs.invalid/tests/env/go/cnitool

go 1.24.0

tool github.com/containernetworking/cni/cnitool

require github.com/containernetworking/cni v1.3.0 // indirect
