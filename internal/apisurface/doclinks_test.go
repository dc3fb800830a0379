package apisurface

import (
	"strings"
	"testing"
)

// TestDocLinksResolve: every doc link of the public packages ([Name],
// [Type.Method], [pkg.Name] into idemq's own packages) names something
// that exists.
func TestDocLinksResolve(t *testing.T) {
	broken, err := BrokenDocLinks("../..", "github.com/idemq/idemq")
	if err != nil {
		t.Fatal(err)
	}
	if len(broken) > 0 {
		t.Errorf("%d doc links name nothing:\n%s", len(broken), strings.Join(broken, "\n"))
	}
}
