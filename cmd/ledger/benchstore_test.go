package main

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/toolcall-ledger/ledger/processors/storetest"
)

func TestParsePIDStat(t *testing.T) {
	// A command name with spaces and a ')' of its own.
	line := "4242 (post gres: x) y) S 77 4242 4242 0 -1 4194560 100 0 0 0 250 50 7 3 20 0 1 0 12345 1000 100\n"
	st, err := parsePIDStat([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	want := procStat{ppid: 77, cpu: 3 * time.Second, children: 100 * time.Millisecond, start: 12345}
	if st != want {
		t.Errorf("parsePIDStat = %+v; want %+v", st, want)
	}
	// A process that ended and awaits its parent's wait: gone, its pid
	// not yet free.
	zombie := strings.Replace(line, ") S 77", ") Z 77", 1)
	if st, err := parsePIDStat([]byte(zombie)); err != nil || !st.exited {
		t.Errorf("parsePIDStat(zombie) = %+v, %v; want it exited", st, err)
	}
	for _, bad := range []string{"", "4242 no name", "4242 (x) S 77 1 2", "4242 (x) S x 4242 4242 0 -1 4194560 100 0 0 0 250 50 7 3 20 0 1 0 12345 1000"} {
		if _, err := parsePIDStat([]byte(bad)); err == nil {
			t.Errorf("parsePIDStat(%q): no error", bad)
		}
	}
}

// fakeProc writes a /proc with a postmaster (pid 10, started 500 ticks
// after boot), two of its backends (11, connected from port 54321, and
// 12, which has reaped a child of its own), and an unrelated process
// (13).
func fakeProc(t *testing.T, comm string) string {
	t.Helper()
	dir := t.TempDir()
	write := func(pid int, name, content string) {
		p := filepath.Join(dir, strconv.Itoa(pid))
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(p, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	stat := func(pid, ppid int, ut, st, cut, cst, start int64) string {
		return fmt.Sprintf("%d (x) S %d 0 0 0 -1 0 0 0 0 0 %d %d %d %d 20 0 1 0 %d 0 0\n", pid, ppid, ut, st, cut, cst, start)
	}
	write(10, "stat", stat(10, 1, 100, 50, 30, 20, 500))
	write(10, "comm", comm+"\n")
	write(11, "stat", stat(11, 10, 200, 100, 0, 0, 900))
	write(11, "cmdline", "postgres: ledger ledger 127.0.0.1(54321) idle\x00")
	write(12, "stat", stat(12, 10, 7, 3, 1, 1, 950))
	write(13, "stat", stat(13, 1, 5000, 5000, 0, 0, 960))
	if err := os.WriteFile(filepath.Join(dir, "stat"), []byte("cpu  1 2 3 4 5 6 7 0 0 0\nbtime 1700000000\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestPGServerAdopt(t *testing.T) {
	const started = 1700000000 + 5 // boot + 500 ticks
	s := &pgServer{proc: fakeProc(t, "postgres")}
	if !s.adopt(11, started, 54321) {
		t.Fatal("adopt: the postgres parent of the backend was not found")
	}
	got, err := s.cpu()
	if err != nil {
		t.Fatal(err)
	}
	// The postmaster's own and reaped (100+50+30+20) and its live
	// children's own and reaped (300 + 10 + 2) ticks; not process 13's.
	if want := 512 * time.Second / clockTicks; got != want {
		t.Errorf("cpu = %v; want %v", got, want)
	}
	// A unix-socket connection has no port to match.
	if s := (&pgServer{proc: fakeProc(t, "postgres")}); !s.adopt(12, started, 0) {
		t.Error("adopt: a backend of a unix-socket connection was not found")
	}
	// The wall clock stepped 15 s against the time since boot since the
	// server started (seen on a virtual machine): still the server.
	if s := (&pgServer{proc: fakeProc(t, "postgres")}); !s.adopt(11, started-15, 54321) {
		t.Error("adopt: the server was not found with its start 15 s off the time since boot")
	}
	for name, c := range map[string]struct {
		comm    string
		backend int
		started float64
		port    int
	}{
		"another start":         {"postgres", 11, started + 10*startSkew, 54321},
		"not postgres":          {"mysqld", 11, started, 54321},
		"no such backend":       {"postgres", 99, started, 54321},
		"the postmaster itself": {"postgres", 10, started, 0},
		"another connection":    {"postgres", 11, started, 54322},
		"no process title":      {"postgres", 12, started, 54321},
	} {
		s := &pgServer{proc: fakeProc(t, c.comm)}
		if s.adopt(c.backend, c.started, c.port) {
			t.Errorf("%s: adopted postmaster %d", name, s.postmaster)
		}
	}
}

// TestFindLocalPostgres: the test store, started on loopback by
// deploy/testservices.sh, is found and its CPU read; a server elsewhere
// (LEDGER_TEST_PG_DSN naming another host, or CockroachDB) is not.
func TestFindLocalPostgres(t *testing.T) {
	dsn := storetest.PGDSN(t)
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.ConnectConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(t.Context())
	var version string
	if err := conn.QueryRow(t.Context(), "SELECT version()").Scan(&version); err != nil {
		t.Fatal(err)
	}
	ip := net.ParseIP(cfg.Host)
	wantLocal := (ip != nil && ip.IsLoopback() || cfg.Host == "localhost" || strings.HasPrefix(cfg.Host, "/")) &&
		strings.HasPrefix(version, "PostgreSQL")
	s, ok := findLocalPostgres(t.Context(), dsn)
	if ok != wantLocal {
		t.Fatalf("findLocalPostgres(%s) = %v; want %v (server %q)", redactDSN(dsn), ok, wantLocal, version)
	}
	if !ok {
		return
	}
	before, err := s.cpu()
	if err != nil {
		t.Fatal(err)
	}
	// Work the server: a second of CPU at least, so that ticks of 10 ms
	// cannot miss it.
	if _, err := conn.Exec(t.Context(), "SELECT count(*) FROM generate_series(1, 20000000)"); err != nil {
		t.Fatal(err)
	}
	after, err := s.cpu()
	if err != nil {
		t.Fatal(err)
	}
	if after-before < 100*time.Millisecond {
		t.Errorf("server CPU went from %v to %v over a query that keeps it busy; want it counted", before, after)
	}
}
