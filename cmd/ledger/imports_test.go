package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestImportDirection keeps the packages layered as STYLE §3.2 says:
// statemachine on the standard library alone, schemas adding only the JSON
// Schema library, processors and projections never importing each other,
// and nothing importing cmd.
func TestImportDirection(t *testing.T) {
	const mod = "github.com/toolcall-ledger/ledger/"
	check := func(pkg string, allowed func(dep string) bool) {
		t.Helper()
		out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", "../../"+pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list %s: %v\n%s", pkg, err, out)
		}
		for _, dep := range strings.Fields(string(out)) {
			if dep != mod+pkg && !allowed(dep) {
				t.Errorf("%s depends on %s", pkg, dep)
			}
		}
	}
	check("statemachine", func(string) bool { return false })
	check("schemas", func(d string) bool {
		return strings.HasPrefix(d, "github.com/santhosh-tekuri/jsonschema/") || strings.HasPrefix(d, "golang.org/x/text")
	})

	out, err := exec.Command("go", "list", "-f", "{{.ImportPath}} {{join .Imports \" \"}}", "../../...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fields := strings.Fields(line)
		pkg, imports := fields[0], fields[1:]
		for _, imp := range imports {
			switch {
			case strings.HasPrefix(imp, mod+"cmd"):
				t.Errorf("%s imports %s: nothing imports cmd", pkg, imp)
			case strings.HasPrefix(pkg, mod+"processors") && strings.HasPrefix(imp, mod+"projections"),
				strings.HasPrefix(pkg, mod+"projections") && strings.HasPrefix(imp, mod+"processors"):
				t.Errorf("%s imports %s: processors and projections never import each other", pkg, imp)
			case strings.HasPrefix(pkg, mod+"ledger") && (strings.HasPrefix(imp, mod+"processors") || strings.HasPrefix(imp, mod+"projections")):
				t.Errorf("%s imports %s: ledger sits below the processors and projections", pkg, imp)
			}
		}
	}
}
