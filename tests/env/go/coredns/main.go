// Command coredns is the test clusters' DNS server: CoreDNS with only the plugins a cluster DNS
// without upstream resolvers needs (no cloud SDKs, so it builds in a couple of minutes).
// Built by tests/env/tools.sh from this module.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/hosts"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// The plugins' order of execution, as in CoreDNS's own plugin.cfg.
func init() {
	dnsserver.Directives = []string{
		"ready", "health", "errors", "log", "hosts", "loadbalance", "cache", "kubernetes", "forward",
	}
}

func main() { coremain.Run() }
