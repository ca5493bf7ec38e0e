package deploytest

import (
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestReadmeProductionCommands checks the README's commands for real
// Kafka and CockroachDB as an operator would run them: every flag and
// LEDGER_ variable is one the command has, the roles that resolve tool
// URLs and decide calls are given the tools' base URL and the policies,
// and every URL one command gives for another's server is served there,
// over TLS when it is https. The block once pointed the API at an
// approvals service listening on loopback only, left the reconciler's
// status lookups on the demo backend's address, and had keys fetched
// over https from a server serving plain HTTP.
func TestReadmeProductionCommands(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	block := readmeBlock(t, string(b), "### Real Kafka and CockroachDB")
	cmds, env := shellCommands(block)
	all, err := realFlags.All()
	if err != nil {
		t.Fatal(err)
	}
	for name := range env {
		if f, ok := envFlag(name); ok && !all[f] {
			t.Errorf("README exports %s, which no role has a flag for", name)
		}
	}
	// settings[instance] are a command's effective flags: its own, and
	// the exported variables of the flags it has.
	type command struct {
		path     []string
		settings map[string]string
	}
	var runs []command
	for _, words := range cmds {
		path := commandPath(words)
		args := words[len(path):]
		flags, err := realFlags.Flags(path)
		if err != nil {
			t.Errorf("README runs ledger %s: %v", strings.Join(path, " "), err)
			continue
		}
		settings := map[string]string{}
		for name, v := range env {
			if f, ok := envFlag(name); ok && flags[f] {
				settings[f] = v
			}
		}
		for i := 0; i < len(args); i++ {
			f, ok := strings.CutPrefix(args[i], "--")
			if !ok {
				t.Errorf("ledger %s: %q is not a flag", strings.Join(path, " "), args[i])
				continue
			}
			name, v, hasValue := strings.Cut(f, "=")
			if !flags[name] {
				t.Errorf("README runs ledger %s with --%s, which it does not have", strings.Join(path, " "), name)
			}
			if !hasValue && i+1 < len(args) && !strings.HasPrefix(args[i+1], "--") {
				i++
				v = args[i]
			}
			settings[name] = v
		}
		runs = append(runs, command{path, settings})
	}
	byInstance := map[string]command{}
	for _, c := range runs {
		if id := c.settings["instance-id"]; id != "" {
			byInstance[id] = c
		}
		switch strings.Join(c.path, " ") {
		case "intake", "executor", "reconciler":
			for _, f := range []string{"tools-base-url", "policy-dir"} {
				if c.settings[f] == "" {
					t.Errorf("README runs ledger %s without --%s: it resolves tool URLs and decides calls with the defaults (the demo backend's address, the demo policies)", c.path[0], f)
				}
			}
		}
	}
	for _, c := range runs {
		for f, v := range c.settings {
			if !strings.HasSuffix(f, "-url") {
				continue
			}
			for _, raw := range strings.Split(v, ",") {
				u, err := url.Parse(raw)
				if err != nil {
					continue
				}
				server, ok := byInstance[u.Hostname()]
				if !ok {
					continue // outside the block: the IdP, the tools
				}
				port := ":" + u.Port()
				if !strings.HasSuffix(server.settings["http-addr"], port) && !strings.HasSuffix(server.settings["jwks-addr"], port) {
					t.Errorf("ledger %s --%s %s: %s serves nothing on %s (--http-addr %q, --jwks-addr %q)", strings.Join(c.path, " "), f, raw,
						u.Hostname(), port, server.settings["http-addr"], server.settings["jwks-addr"])
				}
				if tls := server.settings["http-tls-cert"] != ""; (u.Scheme == "https") != tls {
					t.Errorf("ledger %s --%s %s: %s serves TLS %v", strings.Join(c.path, " "), f, raw, u.Hostname(), tls)
				}
			}
		}
	}
	if len(byInstance) < 4 {
		t.Errorf("README's block runs %d instances; want the roles' (intake, executor, approvals, reconciler)", len(byInstance))
	}
}

// readmeBlock returns the first ```sh block after heading in doc.
func readmeBlock(t *testing.T, doc, heading string) string {
	t.Helper()
	_, after, ok := strings.Cut(doc, heading+"\n")
	if !ok {
		t.Fatalf("README has no %q", heading)
	}
	_, after, ok = strings.Cut(after, "```sh\n")
	if !ok {
		t.Fatalf("README's %q has no sh block", heading)
	}
	block, _, ok := strings.Cut(after, "```")
	if !ok {
		t.Fatalf("README's %q block is not closed", heading)
	}
	return block
}

// shellAssign matches name='value' or name=value.
var shellAssign = regexp.MustCompile(`^([A-Za-z_][A-Za-z0-9_]*)=(?:'([^']*)'|(\S*))$`)

// shellCommands reads the simple shell of a README block: exports and
// assignments (their $name expanded later), and the words of each ledger
// command (continuations joined, comments dropped, && chains split).
func shellCommands(block string) (cmds [][]string, env map[string]string) {
	env = map[string]string{}
	vars := map[string]string{}
	for _, line := range strings.Split(strings.ReplaceAll(block, "\\\n", " "), "\n") {
		if i := strings.Index(line, "#"); i >= 0 {
			line = line[:i]
		}
		for _, part := range strings.Split(line, "&&") {
			words := strings.Fields(part)
			if len(words) == 0 {
				continue
			}
			export := words[0] == "export"
			if export {
				words = words[1:]
			}
			if m := shellAssign.FindStringSubmatch(strings.Join(words, " ")); m != nil && !export {
				vars[m[1]] = m[2] + m[3]
				continue
			}
			if export {
				for _, w := range words {
					if name, v, ok := strings.Cut(w, "="); ok {
						env[name] = strings.Trim(v, "'")
					}
				}
				continue
			}
			var expanded []string
			for _, w := range words {
				if name, ok := strings.CutPrefix(w, "$"); ok {
					expanded = append(expanded, strings.Fields(vars[name])...)
					continue
				}
				expanded = append(expanded, w)
			}
			if expanded[0] == "ledger" {
				cmds = append(cmds, expanded[1:])
			}
		}
	}
	return cmds, env
}
