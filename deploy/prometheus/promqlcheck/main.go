// Command promqlcheck parses PromQL expressions, one per line on stdin, with Prometheus' own parser
// and reports those that do not parse (exit 1). tests/unit/test_deploy.py feeds it every expression
// of deploy/prometheus/alerts.yaml and deploy/grafana/outbox-dispatcher.json; `make tools` builds
// it (a small module instead of promtool, whose build pulls in every service discovery SDK).
package main

import (
	"bufio"
	"fmt"
	"os"

	"github.com/prometheus/prometheus/promql/parser"
)

func main() {
	scanner := bufio.NewScanner(os.Stdin)
	scanner.Buffer(make([]byte, 1<<20), 1<<20)
	p := parser.NewParser(parser.Options{})
	bad := 0
	for n := 1; scanner.Scan(); n++ {
		if _, err := p.ParseExpr(scanner.Text()); err != nil {
			fmt.Printf("line %d: %v\n", n, err)
			bad++
		}
	}
	if bad > 0 {
		os.Exit(1)
	}
}
