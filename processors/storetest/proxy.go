package storetest

// proxy.go: a loopback TCP proxy in front of the SQL server, so that a
// test can break the database connection the way a network, a failover
// or an overloaded node does, while the store under test keeps using its
// ordinary driver and pool.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// PostgreSQL wire-protocol constants (frontend/backend protocol 3.0).
const (
	// Codes of the untyped first messages of a connection.
	codeSSLRequest    = 80877103
	codeGSSENCRequest = 80877104
	codeCancelRequest = 80877102
	// maxStartupLen bounds an untyped startup-phase message: a longer
	// one is not PostgreSQL (or not a client the proxy can read).
	maxStartupLen = 10000
	// maxMessageLen is PostgreSQL's own bound on a message.
	maxMessageLen = 1 << 30
)

// Proxy is a loopback TCP proxy in front of a PostgreSQL or CockroachDB
// server, for database-fault tests: it forwards bytes both ways and, on
// request, cuts connections (CutAll), slows the client's traffic
// (SetDelay) or the commits of one kind of transaction (DelayCommitsOf),
// or lets a COMMIT reach the server and then cuts the connection before
// the answer reaches the client (CutAfterCommit), the ambiguous result a
// store must resolve.
//
// It reads the client's side of the PostgreSQL protocol to find COMMITs,
// whether sent as a simple Query (pgx sends "commit" so) or as an
// extended-protocol Parse/Bind/Execute, and the server's side to find
// the COMMIT's answer. A connection that negotiates TLS or GSS encryption
// cannot be read: it is still forwarded, delayed and cut by CutAll, but
// never cut after a COMMIT (ProxyStats.Opaque counts them). Tests use
// sslmode=disable.
//
// A Proxy is safe for concurrent use. Close it to close every connection.
type Proxy struct {
	target string
	ln     net.Listener
	wg     sync.WaitGroup // the accept loop and every connection

	mu    sync.Mutex
	conns map[*proxyConn]struct{}
	delay time.Duration
	// delayChanged is closed (and replaced) by SetDelay, so that chunks
	// held under the old delay are held under the new one instead.
	delayChanged chan struct{}
	cuts         []*CommitCut
	// commitDelays hold back the COMMITs of the transactions they
	// match (DelayCommitsOf).
	commitDelays []commitDelay
	stats        ProxyStats
	closed       bool
}

// ProxyStats counts what a Proxy did, so that a fault test can show that
// its fault fired.
type ProxyStats struct {
	// Accepted counts client connections, Cancels among them.
	Accepted int
	// Cancels counts connections that carried a CancelRequest (pgx
	// sends one when a query's connection breaks under it).
	Cancels int
	// Cut counts connections closed by CutAll.
	Cut int
	// Delayed counts client-to-server chunks (one read from the client
	// socket, in practice one round trip of the driver) held back by
	// SetDelay.
	Delayed int
	// Commits counts COMMITs forwarded (on CockroachDB, RELEASE
	// SAVEPOINT cockroach_restart, which is where its savepoint protocol
	// commits).
	Commits int
	// CommitCuts counts connections cut after their COMMIT was forwarded
	// and before its answer reached the client.
	CommitCuts int
	// Opaque counts connections that negotiated encryption, which the
	// proxy forwards without reading.
	Opaque int
	// RoundTrips counts the client messages that each end a pipeline and
	// wait for the server's ReadyForQuery (Query, Sync, FunctionCall):
	// the round trips a driver such as pgx makes.
	RoundTrips int
	// CommitsDelayed counts COMMITs held back by DelayCommitsOf.
	CommitsDelayed int
	// LargestMessage is the length of the largest message a client sent
	// (a statement's Bind with its parameters, say), in bytes: CockroachDB
	// refuses one past 16 MiB, where PostgreSQL takes up to 1 GiB.
	LargestMessage int
}

// commitDelay is one DelayCommitsOf: COMMITs of transactions that ran a
// statement containing match are held d.
type commitDelay struct {
	match string
	d     time.Duration
}

// CommitCut is one arming of CutAfterCommit. Its counters say what it
// did; they are safe to read while the proxy runs.
type CommitCut struct {
	p     *Proxy
	match string
	// Guarded by p.mu.
	left, fired, committed, failed int
}

// Fired is how many connections this arming cut after a COMMIT.
func (c *CommitCut) Fired() int {
	c.p.mu.Lock()
	defer c.p.mu.Unlock()
	return c.fired
}

// Committed is how many of the COMMITs it cut the server answered as
// committed: transactions that took effect although their client got an
// error.
func (c *CommitCut) Committed() int {
	c.p.mu.Lock()
	defer c.p.mu.Unlock()
	return c.committed
}

// Failed is how many of the COMMITs it cut the server answered with an
// error or ROLLBACK (a serialization failure at commit, a transaction
// already aborted): transactions that did not take effect. Fired minus
// Committed minus Failed were cut before the answer came (CutAll, Close).
func (c *CommitCut) Failed() int {
	c.p.mu.Lock()
	defer c.p.mu.Unlock()
	return c.failed
}

// Left is how many more COMMITs this arming will cut.
func (c *CommitCut) Left() int {
	c.p.mu.Lock()
	defer c.p.mu.Unlock()
	return c.left
}

// NewProxy starts a proxy on 127.0.0.1 (a free port) in front of target,
// a host:port.
func NewProxy(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("proxy: listen: %w", err)
	}
	p := &Proxy{target: target, ln: ln, conns: make(map[*proxyConn]struct{}), delayChanged: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// StartProxy starts a Proxy in front of the server of dsn (as PGDSN
// returns it) for the duration of the test, and returns it with the DSN
// that reaches the server through it.
func StartProxy(t testing.TB, dsn string) (*Proxy, string) {
	t.Helper()
	target, err := PGAddr(dsn)
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewProxy(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	proxied, err := p.DSN(dsn)
	if err != nil {
		t.Fatal(err)
	}
	return p, proxied
}

// PGAddr returns the host:port of the (first) server a DSN names.
func PGAddr(dsn string) (string, error) {
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		// The DSN may hold a password: do not echo it.
		return "", errors.New("proxy: cannot parse DSN")
	}
	if strings.HasPrefix(cfg.Host, "/") {
		return "", errors.New("proxy: the DSN names a Unix socket; the proxy needs TCP")
	}
	return net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), nil
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// DSN returns dsn pointed at the proxy: a URL's host:port replaced (all
// of its hosts, for a multi-host URL), or host and port appended to a
// keyword/value DSN (where the last setting wins).
func (p *Proxy) DSN(dsn string) (string, error) {
	host, port, err := net.SplitHostPort(p.Addr())
	if err != nil {
		return "", fmt.Errorf("proxy: %w", err)
	}
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			return "", errors.New("proxy: cannot parse DSN")
		}
		u.Host = p.Addr()
		return u.String(), nil
	}
	return strings.TrimSpace(dsn) + " host=" + host + " port=" + port, nil
}

// SetDelay holds back every chunk the clients send by d before
// forwarding it, so that every round trip takes d longer: slow queries as
// an overloaded or distant server gives them. It applies at once to the
// chunks already held too (each is held d since it arrived), so that
// SetDelay(0) heals at once even after a delay long enough to stall the
// clients.
func (p *Proxy) SetDelay(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.delay = d
	close(p.delayChanged)
	p.delayChanged = make(chan struct{})
}

// CutAll closes every open connection, both ways, at once, and returns
// how many. New connections are accepted as before.
func (p *Proxy) CutAll() int {
	p.mu.Lock()
	conns := make([]*proxyConn, 0, len(p.conns))
	for pc := range p.conns {
		conns = append(conns, pc)
	}
	p.stats.Cut += len(conns)
	p.mu.Unlock()
	for _, pc := range conns {
		pc.close()
	}
	return len(conns)
}

// CutAfterCommit arms the proxy for the next n transactions to commit,
// on any connection: each one's COMMIT is forwarded to the server, the
// proxy waits for the server's answer, drops it, and closes the
// connection. The transaction has committed (or failed, see
// CommitCut.Failed) and its client cannot know which.
func (p *Proxy) CutAfterCommit(n int) *CommitCut {
	return p.CutAfterCommitOf(n, "")
}

// CutAfterCommitOf is CutAfterCommit for transactions that ran a
// statement whose SQL contains match (case-sensitive), so that a test
// can aim at one kind of transaction. An empty match takes any. Armings
// are served in the order they were made.
func (p *Proxy) CutAfterCommitOf(n int, match string) *CommitCut {
	c := &CommitCut{p: p, match: match, left: n}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cuts = append(p.cuts, c)
	return c
}

// DelayCommitsOf holds back, by d, the COMMIT of every transaction that
// ran a statement whose SQL contains match (case-sensitive), from now on:
// the statements reach the server at once, and the transaction's commit
// (and so its client's answer) comes d later, as on a server whose
// commits are slow. A test can so make one kind of transaction outlast
// a lease, whatever the machine's speed. A d of 0 stops it.
func (p *Proxy) DelayCommitsOf(match string, d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.commitDelays = slices.DeleteFunc(p.commitDelays, func(c commitDelay) bool { return c.match == match })
	if d > 0 {
		p.commitDelays = append(p.commitDelays, commitDelay{match: match, d: d})
	}
}

// commitHeld is how long to hold the COMMIT of a transaction that ran
// stmts: the longest delay whose match one of them contains.
func (p *Proxy) commitHeld(stmts []string) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	var d time.Duration
	for _, c := range p.commitDelays {
		if c.d > d && ranMatching(stmts, c.match) {
			d = c.d
		}
	}
	if d > 0 {
		p.stats.CommitsDelayed++
	}
	return d
}

// Stats returns what the proxy did so far.
func (p *Proxy) Stats() ProxyStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stats
}

// Close stops accepting, closes every connection and waits for the
// proxy's goroutines to end.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	conns := make([]*proxyConn, 0, len(p.conns))
	for pc := range p.conns {
		conns = append(conns, pc)
	}
	p.mu.Unlock()
	err := p.ln.Close()
	for _, pc := range conns {
		pc.close()
	}
	p.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil // closed twice
	}
	return err
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		p.wg.Add(1)
		go p.serve(client)
	}
}

// serve proxies one connection until either side closes it or the proxy
// cuts it.
func (p *Proxy) serve(client net.Conn) {
	defer p.wg.Done()
	server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		client.Close() // the client sees the server as down
		return
	}
	pc := &proxyConn{
		p: p, client: client, server: server,
		done:       make(chan struct{}),
		negotiated: make(chan byte, 1),
		startup:    true,
		stmts:      make(map[string]string),
		portals:    make(map[string]string),
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		pc.close()
		return
	}
	p.conns[pc] = struct{}{}
	p.stats.Accepted++
	p.mu.Unlock()

	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); pc.clientToServer() }()
	go func() { defer wg.Done(); pc.serverToClient() }()
	wg.Wait()

	p.mu.Lock()
	delete(p.conns, pc)
	p.mu.Unlock()
}

// hold waits out the delay before a chunk that arrived now is
// forwarded; false when the connection closed meanwhile.
func (p *Proxy) hold(done <-chan struct{}) bool {
	arrived := time.Now()
	counted := false
	for {
		p.mu.Lock()
		d, changed := p.delay, p.delayChanged
		if d > 0 && !counted {
			counted = true
			p.stats.Delayed++
		}
		p.mu.Unlock()
		wait := time.Until(arrived.Add(d))
		if wait <= 0 {
			return true
		}
		t := time.NewTimer(wait)
		select {
		case <-done:
			t.Stop()
			return false
		case <-changed:
			t.Stop() // held under the new delay
		case <-t.C:
			return true
		}
	}
}

// takeCut returns the first arming that wants a transaction that ran
// stmts, and counts the COMMIT.
func (p *Proxy) takeCut(stmts []string) *CommitCut {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stats.Commits++
	for _, c := range p.cuts {
		if c.left <= 0 || !c.matches(stmts) {
			continue
		}
		c.left--
		c.fired++
		p.stats.CommitCuts++
		return c
	}
	return nil
}

func (c *CommitCut) matches(stmts []string) bool { return ranMatching(stmts, c.match) }

// ranMatching reports whether a transaction that ran stmts ran one whose
// SQL contains match; any transaction does for an empty match.
func ranMatching(stmts []string, match string) bool {
	if match == "" {
		return true
	}
	for _, s := range stmts {
		if strings.Contains(s, match) {
			return true
		}
	}
	return false
}

// answered records the server's answer to a COMMIT that c cut.
func (c *CommitCut) answered(committed bool) {
	c.p.mu.Lock()
	defer c.p.mu.Unlock()
	if committed {
		c.committed++
	} else {
		c.failed++
	}
}

// proxyConn is one proxied connection and the protocol state of both
// directions.
type proxyConn struct {
	p              *Proxy
	client, server net.Conn
	closeOnce      sync.Once
	done           chan struct{} // closed by close
	// negotiated carries the server's one-byte answer to an SSLRequest
	// or GSSENCRequest from the server-to-client pump to the other.
	negotiated chan byte

	// Client-to-server state, owned by clientToServer.
	startup bool              // before the StartupMessage: untyped messages
	opaque  bool              // encrypted or unreadable: forward as is
	stmts   map[string]string // prepared statement name → SQL
	portals map[string]string // portal name → SQL
	txSQL   []string          // statements of the open transaction
	// released: CockroachDB's RELEASE SAVEPOINT cockroach_restart
	// committed the transaction; the COMMIT after it is a formality.
	released bool

	mu sync.Mutex
	// syncs counts the client messages that each earn exactly one
	// ReadyForQuery (StartupMessage, Query, Sync, FunctionCall)
	// forwarded so far.
	syncs int
	// expectNegotiation: an SSLRequest or GSSENCRequest was forwarded;
	// the server's next byte is its untyped answer.
	expectNegotiation bool
	// cut, when set, is the arming that took this connection's COMMIT;
	// the server's answer to it is, after cutAfterZ ReadyForQuery
	// messages, the CommandComplete after cutSkip others (the answers to
	// the statements pipelined ahead of it, BEGIN included, before one
	// Sync), or the first ErrorResponse: after an error the server skips
	// the rest of the pipeline, its COMMIT too.
	cut       *CommitCut
	cutAfterZ int
	cutSkip   int
	// executes counts the Execute messages since the last Sync or Query:
	// the statements of the pipeline being sent.
	executes int
}

func (pc *proxyConn) close() {
	pc.closeOnce.Do(func() {
		close(pc.done)
		pc.client.Close()
		pc.server.Close()
	})
}

func (pc *proxyConn) clientToServer() {
	defer pc.close()
	var buf []byte
	rd := make([]byte, 32<<10)
	for {
		n, err := pc.client.Read(rd)
		if n > 0 {
			if !pc.p.hold(pc.done) {
				return
			}
			buf = append(buf, rd[:n]...)
			var ok bool
			if buf, ok = pc.forwardClient(buf); !ok {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// forwardClient forwards the complete messages at the start of buf and
// returns the incomplete rest; false when the connection is done.
func (pc *proxyConn) forwardClient(buf []byte) ([]byte, bool) {
	var out []byte
	i := 0
	flush := func() bool {
		if len(out) == 0 {
			return true
		}
		_, err := pc.server.Write(out)
		out = out[:0]
		return err == nil
	}
	for !pc.opaque {
		rest := buf[i:]
		if pc.startup {
			if len(rest) < 8 {
				break
			}
			l := int(binary.BigEndian.Uint32(rest))
			if l < 8 || l > maxStartupLen {
				pc.becomeOpaque()
				break
			}
			if len(rest) < l {
				break
			}
			code := binary.BigEndian.Uint32(rest[4:])
			out = append(out, rest[:l]...)
			i += l
			switch code {
			case codeSSLRequest, codeGSSENCRequest:
				pc.mu.Lock()
				pc.expectNegotiation = true
				pc.mu.Unlock()
				if !flush() {
					return nil, false
				}
				select {
				case <-pc.done:
					return nil, false
				case b := <-pc.negotiated:
					if b != 'N' {
						// Encrypted from here on, or an error.
						pc.becomeOpaque()
					}
				}
			case codeCancelRequest:
				// Nothing follows on this connection.
				pc.p.mu.Lock()
				pc.p.stats.Cancels++
				pc.p.mu.Unlock()
			default:
				// The StartupMessage: typed messages follow, and the
				// server ends the startup with a ReadyForQuery.
				pc.startup = false
				pc.mu.Lock()
				pc.syncs++
				pc.mu.Unlock()
			}
			continue
		}
		if len(rest) < 5 {
			break
		}
		l := int(binary.BigEndian.Uint32(rest[1:]))
		if l < 4 || l > maxMessageLen {
			pc.becomeOpaque()
			break
		}
		if len(rest) < 1+l {
			break
		}
		typ, body := rest[0], rest[5:1+l]
		pc.p.mu.Lock()
		pc.p.stats.LargestMessage = max(pc.p.stats.LargestMessage, 1+l)
		pc.p.mu.Unlock()
		commit := pc.track(typ, body)
		if commit {
			stmts := pc.txSQL
			pc.txSQL = nil
			if d := pc.p.commitHeld(stmts); d > 0 {
				// What came before the COMMIT goes now; the COMMIT
				// after d.
				if !flush() {
					return nil, false
				}
				t := time.NewTimer(d)
				select {
				case <-pc.done:
					t.Stop()
					return nil, false
				case <-t.C:
				}
			}
			if c := pc.p.takeCut(stmts); c != nil {
				// Armed before the COMMIT leaves, so that its answer
				// cannot reach the other pump first.
				pc.mu.Lock()
				pc.cut, pc.cutAfterZ, pc.cutSkip = c, pc.syncs, pc.executes
				pc.mu.Unlock()
			}
		}
		switch typ {
		case 'E':
			pc.executes++
		case 'Q', 'S', 'F':
			pc.executes = 0
			pc.mu.Lock()
			pc.syncs++
			pc.mu.Unlock()
			pc.p.mu.Lock()
			pc.p.stats.RoundTrips++
			pc.p.mu.Unlock()
		}
		out = append(out, rest[:1+l]...)
		i += 1 + l
	}
	if pc.opaque {
		out = append(out, buf[i:]...)
		i = len(buf)
	}
	if !flush() {
		return nil, false
	}
	// Keep the incomplete rest, in a fresh slice so that buf's array is
	// not kept growing.
	return append([]byte(nil), buf[i:]...), true
}

func (pc *proxyConn) becomeOpaque() {
	if pc.opaque {
		return
	}
	pc.opaque = true
	pc.p.mu.Lock()
	pc.p.stats.Opaque++
	pc.p.mu.Unlock()
}

// track follows the statements of the open transaction and reports
// whether the message commits it.
func (pc *proxyConn) track(typ byte, body []byte) bool {
	switch typ {
	case 'Q': // Query: the SQL
		sql, _ := cstring(body)
		return pc.statement(sql)
	case 'P': // Parse: statement name, SQL, parameter types
		name, rest := cstring(body)
		sql, _ := cstring(rest)
		pc.stmts[name] = sql
	case 'B': // Bind: portal name, statement name, ...
		portal, rest := cstring(body)
		stmt, _ := cstring(rest)
		pc.portals[portal] = pc.stmts[stmt]
	case 'E': // Execute: portal name, row limit
		portal, _ := cstring(body)
		return pc.statement(pc.portals[portal])
	case 'C': // Close: 'S' statement or 'P' portal, name
		if len(body) > 0 {
			name, _ := cstring(body[1:])
			if body[0] == 'S' {
				delete(pc.stmts, name)
			} else {
				delete(pc.portals, name)
			}
		}
	}
	return false
}

// statement records one executed statement and reports whether it
// commits the transaction.
func (pc *proxyConn) statement(sql string) bool {
	switch classify(sql) {
	case stmtBegin, stmtRollback:
		pc.txSQL, pc.released = nil, false
	case stmtCommit:
		if pc.released {
			// After CockroachDB's RELEASE: the commit already happened.
			pc.released = false
			pc.txSQL = nil
			return false
		}
		return true
	case stmtRelease:
		pc.released = true
		return true
	default:
		pc.txSQL = append(pc.txSQL, sql)
	}
	return false
}

type stmtKind int

const (
	stmtOther stmtKind = iota
	stmtBegin
	stmtCommit
	stmtRollback
	// stmtRelease is RELEASE SAVEPOINT cockroach_restart, the commit of
	// CockroachDB's savepoint retry protocol.
	stmtRelease
)

// classify sorts a statement's SQL as transaction control or not. Only a
// statement that is exactly one transaction-control command counts.
func classify(sql string) stmtKind {
	s := strings.ToLower(strings.Join(strings.Fields(strings.TrimRight(strings.TrimSpace(sql), "; \t\r\n")), " "))
	switch s {
	case "commit", "commit work", "commit transaction", "end", "end work", "end transaction":
		return stmtCommit
	case "rollback", "rollback work", "rollback transaction", "abort", "abort work", "abort transaction":
		return stmtRollback
	case "release savepoint cockroach_restart", "release cockroach_restart":
		return stmtRelease
	}
	if s == "begin" || strings.HasPrefix(s, "begin ") || strings.HasPrefix(s, "start transaction") {
		return stmtBegin
	}
	return stmtOther
}

// cstring splits a NUL-terminated string off b.
func cstring(b []byte) (string, []byte) {
	for i, c := range b {
		if c == 0 {
			return string(b[:i]), b[i+1:]
		}
	}
	return string(b), nil
}

func (pc *proxyConn) serverToClient() {
	defer pc.close()
	var (
		buf    []byte
		opaque bool
		zSeen  int
	)
	rd := make([]byte, 32<<10)
	for {
		n, err := pc.server.Read(rd)
		if n > 0 {
			buf = append(buf, rd[:n]...)
			var out []byte
			i := 0
			for !opaque && i < len(buf) {
				pc.mu.Lock()
				negotiating := pc.expectNegotiation
				pc.expectNegotiation = false
				cut, cutAfterZ, cutSkip := pc.cut, pc.cutAfterZ, pc.cutSkip
				pc.mu.Unlock()
				if negotiating {
					b := buf[i]
					out = append(out, b)
					i++
					opaque = b != 'N'
					pc.negotiated <- b
					continue
				}
				rest := buf[i:]
				if len(rest) < 5 {
					break
				}
				l := int(binary.BigEndian.Uint32(rest[1:]))
				if l < 4 || l > maxMessageLen {
					opaque = true
					break
				}
				if len(rest) < 1+l {
					break
				}
				typ, body := rest[0], rest[5:1+l]
				i += 1 + l
				if cut != nil && zSeen >= cutAfterZ {
					// Everything before the COMMIT's pipeline is
					// answered: past the answers to the statements ahead
					// of it, what comes answers the COMMIT, and never
					// reaches the client. Its CommandComplete (or an
					// ErrorResponse) says whether it committed; then the
					// connection closes.
					if typ == 'C' && cutSkip > 0 {
						pc.mu.Lock()
						pc.cutSkip--
						pc.mu.Unlock()
						out = append(out, rest[:1+l]...)
						continue
					}
					if typ != 'C' && typ != 'E' {
						if cutSkip > 0 {
							out = append(out, rest[:1+l]...)
						}
						continue
					}
					tag, _ := cstring(body)
					cut.answered(typ == 'C' && tag == "COMMIT")
					if len(out) > 0 {
						_, _ = pc.client.Write(out)
					}
					return // closes both sides
				}
				if typ == 'Z' {
					zSeen++
				}
				out = append(out, rest[:1+l]...)
			}
			if opaque {
				out = append(out, buf[i:]...)
				i = len(buf)
			}
			if len(out) > 0 {
				if _, err := pc.client.Write(out); err != nil {
					return
				}
			}
			buf = append([]byte(nil), buf[i:]...)
		}
		if err != nil {
			return
		}
	}
}
