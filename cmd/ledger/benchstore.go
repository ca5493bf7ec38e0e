package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// clockTicks is USER_HZ, the unit of /proc's CPU times: 100 a second on
// every Linux that exports them.
const clockTicks = 100

// procStat is what the bench reads of /proc/<pid>/stat.
type procStat struct {
	ppid int
	// cpu is utime + stime; children is cutime + cstime, the CPU of the
	// children it has reaped.
	cpu, children time.Duration
	// start is the process's start, in ticks after boot.
	start int64
	// exited: the process has ended and waits to be reaped (a zombie,
	// state Z or X), its pid not yet free.
	exited bool
}

// readProcStat reads <proc>/<pid>/stat (Linux only; proc is /proc but
// in tests).
func readProcStat(proc string, pid int) (procStat, error) {
	b, err := os.ReadFile(filepath.Join(proc, strconv.Itoa(pid), "stat"))
	if err != nil {
		return procStat{}, err
	}
	return parsePIDStat(b)
}

// parsePIDStat parses a /proc/<pid>/stat line. The command name may hold
// spaces and parentheses: the fields resume after its last ')'.
func parsePIDStat(b []byte) (procStat, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, fmt.Errorf("stat line without a command name")
	}
	// After the name: state(3) ppid(4) ... utime(14) stime(15) cutime(16)
	// cstime(17) ... starttime(22); f[0] is field 3.
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return procStat{}, fmt.Errorf("stat line of %d fields", len(f)+2)
	}
	n := func(field int) int64 {
		v, err := strconv.ParseInt(f[field-3], 10, 64)
		if err != nil {
			return -1
		}
		return v
	}
	ppid, ut, st, cut, cst, start := n(4), n(14), n(15), n(16), n(17), n(22)
	if ppid < 0 || ut < 0 || st < 0 || cut < 0 || cst < 0 || start < 0 {
		return procStat{}, fmt.Errorf("stat line with unreadable numbers")
	}
	tick := time.Second / clockTicks
	return procStat{ppid: int(ppid), cpu: time.Duration(ut+st) * tick, children: time.Duration(cut+cst) * tick, start: start,
		exited: f[0] == "Z" || f[0] == "X"}, nil
}

// pgServer is a PostgreSQL server running on this machine, found from a
// connection to it, whose CPU the bench can read: the postmaster's own, its
// reaped children's and its live children's (the backends, autovacuum,
// the WAL writer...).
type pgServer struct {
	postmaster int
	proc       string // /proc, or a test's copy
}

// findLocalPostgres finds the server behind dsn on this machine. ok is
// false when it is elsewhere (another host, another PID namespace), is
// not PostgreSQL (CockroachDB answers pg_backend_pid with a made-up
// number), or /proc cannot tell: the bench then leaves the column out
// rather than count some other process.
func findLocalPostgres(ctx context.Context, dsn string) (_ *pgServer, ok bool) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, false
	}
	defer conn.Close(context.Background())
	var (
		backend int
		started float64
	)
	port := 0
	if a, ok := conn.PgConn().Conn().LocalAddr().(*net.TCPAddr); ok {
		port = a.Port
	}
	// CockroachDB has no pg_postmaster_start_time: the query fails there.
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid(), extract(epoch FROM pg_postmaster_start_time())::float8").Scan(&backend, &started); err != nil {
		return nil, false
	}
	s := &pgServer{proc: "/proc"}
	return s, s.adopt(backend, started, port)
}

// adopt makes s the server of the backend process backend, if /proc
// agrees that its parent is a postgres process started when the server
// says it started (unix seconds), and, for a TCP connection from
// clientPort, that the backend's process title names that port, as
// PostgreSQL's titles do ("postgres: user db 127.0.0.1(54321) idle"). A
// server in another PID namespace reports pids that may be any local
// process's, even another local PostgreSQL's backend.
func (s *pgServer) adopt(backend int, started float64, clientPort int) bool {
	b, err := readProcStat(s.proc, backend)
	if err != nil {
		return false
	}
	if clientPort > 0 {
		title, err := os.ReadFile(filepath.Join(s.proc, strconv.Itoa(backend), "cmdline"))
		if err != nil || !bytes.Contains(title, []byte("("+strconv.Itoa(clientPort)+")")) {
			return false
		}
	}
	pm, err := readProcStat(s.proc, b.ppid)
	if err != nil {
		return false
	}
	comm, err := os.ReadFile(filepath.Join(s.proc, strconv.Itoa(b.ppid), "comm"))
	if err != nil || !strings.HasPrefix(strings.TrimSpace(string(comm)), "postgres") {
		return false
	}
	boot, ok := bootTime(s.proc)
	if !ok {
		return false
	}
	// A process of another PID namespace that happens to have the pid
	// would not have started at the same moment. Within a minute: the
	// server's start is on the wall clock, /proc's on the time since
	// boot, and a virtual machine's wall clock is stepped against it
	// (a pause, NTP): 15 s within ten minutes has been seen.
	if at := float64(boot) + float64(pm.start)/clockTicks; math.Abs(at-started) > startSkew {
		return false
	}
	s.postmaster = b.ppid
	return true
}

// startSkew is how far apart the server's start as it reports it and as
// /proc tells it may be (adopt).
const startSkew = 60

// cpu is the server's CPU time so far: the postmaster's own and reaped
// children's, and each live child's own and reaped children's. A backend
// that exits during a run moves its whole time into the postmaster's
// reaped-children time, which the difference of two readings then counts
// once. One reaped between the postmaster's reading and the scan of its
// children would be counted in neither, so the reading is taken again
// until the postmaster reaped nothing meanwhile.
func (s *pgServer) cpu() (time.Duration, error) {
	for range 5 {
		pm, err := readProcStat(s.proc, s.postmaster)
		if err != nil {
			return 0, err
		}
		total := pm.cpu + pm.children
		entries, err := os.ReadDir(s.proc)
		if err != nil {
			return 0, err
		}
		for _, e := range entries {
			pid, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			c, err := readProcStat(s.proc, pid)
			if err != nil || c.ppid != s.postmaster {
				// Gone meanwhile, or not the server's.
				continue
			}
			total += c.cpu + c.children
		}
		again, err := readProcStat(s.proc, s.postmaster)
		if err != nil {
			return 0, err
		}
		if again.children == pm.children {
			return total, nil
		}
	}
	return 0, errors.New("the server's processes kept exiting while read")
}

// bootTime is the machine's boot, unix seconds, from /proc/stat's btime.
func bootTime(proc string) (int64, bool) {
	b, err := os.ReadFile(filepath.Join(proc, "stat"))
	if err != nil {
		return 0, false
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "btime "); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}
