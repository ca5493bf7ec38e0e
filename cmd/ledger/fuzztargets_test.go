package main

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Every fuzz target in the repository is in the Makefile's FUZZ_TARGETS,
// which make test and make fuzz run: the JWS verifier's, the parser of
// agents' untrusted assertions, was left out, and only its seeds ran.
func TestEveryFuzzTargetRuns(t *testing.T) {
	mk, err := os.ReadFile("../../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	// The variable's value, its continuation lines joined.
	m := regexp.MustCompile(`(?m)^FUZZ_TARGETS\s*=((?:.*\\\n)*.*)$`).FindSubmatch(mk)
	if m == nil {
		t.Fatal("the Makefile sets no FUZZ_TARGETS")
	}
	listed := map[string]bool{}
	for _, f := range strings.Fields(strings.ReplaceAll(string(m[1]), "\\\n", " ")) {
		listed[f] = true
	}
	fuzzFunc := regexp.MustCompile(`(?m)^func (Fuzz\w+)\(`)
	found := 0
	err = filepath.WalkDir("../..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != "../.." && strings.HasPrefix(d.Name(), ".") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		pkg, err := filepath.Rel("../..", filepath.Dir(path))
		if err != nil {
			return err
		}
		for _, fn := range fuzzFunc.FindAllSubmatch(b, -1) {
			found++
			if target := filepath.ToSlash(pkg) + ":" + string(fn[1]); !listed[target] {
				t.Errorf("fuzz target %s (%s) is not in the Makefile's FUZZ_TARGETS: make test and make fuzz never run it", target, path)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if found == 0 {
		t.Fatal("no fuzz target found: the walk is wrong")
	}
}
