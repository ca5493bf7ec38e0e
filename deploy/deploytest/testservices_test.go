package deploytest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// deploy/testservices.sh keeps the services a user names: a PostgreSQL DSN
// it has no client to check (neither psql nor pg_isready here), and a
// ClickHouse DSN, which the tests use over the address, are used as
// given, nothing installed or started in their place; and the exports
// hold a password with a quote as it is. Before, it installed and started
// a private PostgreSQL (a CockroachDB run became a PostgreSQL one, or,
// without apt-get, failed), and a private ClickHouse the tests did not
// use, and a quote broke the shell sourcing the exports.
func TestTestservicesKeepsTheUsersServices(t *testing.T) {
	bin := t.TempDir()
	// The tools the script needs, and none of the services' clients.
	for _, tool := range []string{"bash", "cat", "chmod", "dirname", "flock", "getent", "grep", "id", "ls", "mkdir", "printf", "rm", "sleep", "sort", "timeout", "tr"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Fatalf("%s: %v", tool, err)
		}
		if err := os.Symlink(p, filepath.Join(bin, tool)); err != nil {
			t.Fatal(err)
		}
	}
	const (
		pgDSN = "postgres://ledger:it's%20a@crdb.example:26257/ledger?sslmode=disable&x=1"
		chDSN = "clickhouse://ledger:pw@ch.example:9000/ledger"
	)
	script, err := filepath.Abs(filepath.Join("..", "testservices.sh"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(bin, "bash"), script, "start")
	cmd.Env = []string{"PATH=" + bin, "HOME=" + t.TempDir(), "LEDGER_TEST_STATE=" + t.TempDir(),
		"LEDGER_TEST_PG_DSN=" + pgDSN, "LEDGER_TEST_CLICKHOUSE_DSN=" + chDSN, "LEDGER_TEST_CHROMIUM=" + filepath.Join(bin, "bash")}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("testservices.sh start: %v\n%s", err, errb.String())
	}
	if strings.Contains(errb.String(), "apt-get") || strings.Contains(errb.String(), "starting") {
		t.Errorf("testservices.sh start installed or started something for services the user named:\n%s", errb.String())
	}
	// The exports, sourced as make test does.
	check := exec.Command(filepath.Join(bin, "bash"), "-c", `source /dev/stdin && printf '%s\n' "$LEDGER_TEST_PG_DSN"`)
	check.Stdin = &out
	got, err := check.Output()
	if err != nil {
		t.Fatalf("sourcing the exports: %v", err)
	}
	if strings.TrimSpace(string(got)) != pgDSN {
		t.Errorf("LEDGER_TEST_PG_DSN sourced %q; want %q", strings.TrimSpace(string(got)), pgDSN)
	}
}
