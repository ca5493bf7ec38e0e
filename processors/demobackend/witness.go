package demobackend

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"time"
)

// Effect is one request that a tool handled, as the witness saw it: a new
// side effect, a native replay (Replay: no new effect) or a read (Read: no
// side effect at all). Requests refused before the tool ran (bad input,
// injected FailStatus, a 409 key reuse, a hang) are not effects.
type Effect struct {
	// Seq numbers the effects of one Server from 1, in the order applied.
	Seq            int64  `json:"seq"`
	Tool           string `json:"tool"`
	IdempotencyKey string `json:"idempotency_key"`
	CallID         string `json:"call_id,omitempty"`
	TenantID       string `json:"tenant_id,omitempty"`
	Attempt        int    `json:"attempt,omitempty"`
	// ArgsHash is the lowercase hex sha256 of the request body.
	ArgsHash string    `json:"args_hash"`
	At       time.Time `json:"at"`
	// Received is when the request reached the tool: when the caller
	// started the effect. At, when it was applied, is later by whatever
	// the tool spent first (reading the body, a latency, a busy lock).
	Received time.Time `json:"received,omitzero"`
	// Replay: a native tool answered from its record of an earlier request
	// with the same (tenant, key); nothing new happened.
	Replay bool `json:"replay,omitempty"`
	// Read: the tool has no side effect (get_weather).
	Read bool `json:"read,omitempty"`
	// JTI is the jti of the credential the request carried, when the
	// backend verifies credentials (Config.Credentials): what an incident
	// responder asks about ("what did jti X touch").
	JTI string `json:"jti,omitempty"`
	// CredentialIssued is that credential's iat: a call keeps one jti
	// over all its executions, and each mints its credential anew.
	CredentialIssued time.Time `json:"credential_issued,omitzero"`
	// Traceparent is the W3C trace context the request carried: the
	// agent's trace, propagated by the ledger.
	Traceparent string `json:"traceparent,omitempty"`
	// Result is a native tool's answer to a new effect, which it replays
	// to the key's later requests and serves to its status lookup:
	// journaled, so that a backend restarted on its journal still has it
	// (Open).
	Result json.RawMessage `json:"result,omitempty"`
	// Resource is the resource (order_id) whose version the effect
	// moved on, for the same reason.
	Resource string `json:"resource,omitempty"`
}

// recordLocked appends ef to the witness and the journal. The journal line
// is written first: if it fails, the effect is not applied at all, so the
// journal never misses an effect. s.mu must be held.
func (s *Server) recordLocked(ef Effect) error {
	if s.journalErr != nil {
		return fmt.Errorf("journal: %v", s.journalErr)
	}
	ef.Seq = s.seq + 1
	ef.At = s.now()
	if s.journal != nil {
		line, err := json.Marshal(ef)
		if err != nil {
			return fmt.Errorf("encode effect: %v", err)
		}
		// One write per line: O_APPEND makes it land whole at the end even
		// when several processes share the file.
		if _, err := s.journal.Write(append(line, '\n')); err != nil {
			// The line may be in the file in part (a full disk): the
			// next one would run on from it. Nothing more is written
			// until a restart, whose Open cuts it off.
			s.logger.Error("write effect journal; no effect is applied until the backend restarts", "err", err)
			s.journalErr = err
			return fmt.Errorf("write journal: %v", err)
		}
	}
	s.seq = ef.Seq
	s.effects = append(s.effects, ef)
	s.logger.Debug("tool effect", "tool", ef.Tool, "tenant_id", ef.TenantID, "idempotency_key", ef.IdempotencyKey,
		"attempt", ef.Attempt, "replay", ef.Replay, "read", ef.Read, "seq", ef.Seq, "jti", ef.JTI)
	return nil
}

// Effects returns a copy of every effect so far, in order.
func (s *Server) Effects() []Effect {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Effect, len(s.effects))
	copy(out, s.effects)
	return out
}

// effectsWhere returns the effects keep is true of, in order.
func (s *Server) effectsWhere(keep func(*Effect) bool) []Effect {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := []Effect{}
	for i := range s.effects {
		if keep(&s.effects[i]) {
			out = append(out, s.effects[i])
		}
	}
	return out
}

// Forget drops what the server holds of the requests so far: the
// effects, the refusals and the native tools' stored answers. It is for a
// harness that checks runs one after another, each with idempotency keys
// of its own (ledger bench): the server then holds one run's requests,
// not every run's, and a long benchmark's later runs do not share the
// machine with a heap that grew with the earlier ones. A request reusing
// a key from before is a new effect, not a replay. Seq goes on counting,
// and the journal, if any, keeps every line.
func (s *Server) Forget() {
	s.mu.Lock()
	defer s.mu.Unlock()
	// New slices and map: cleared ones would keep their peak size.
	s.effects, s.refusals = nil, nil
	s.stored = make(map[dedupeKey]storedCall)
}

// Applied returns how many requests to tool with idempotencyKey were handled
// as new effects (not replays), summed over tenants. For a side-effecting
// tool, anything above 1 is a duplicate side effect. For get_weather it
// counts reads.
func (s *Server) Applied(tool, idempotencyKey string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, ef := range s.effects {
		if ef.Tool == tool && ef.IdempotencyKey == idempotencyKey && !ef.Replay {
			n++
		}
	}
	return n
}

// AppliedIn is Applied for one tenant's key: the ledger's notion of one call.
func (s *Server) AppliedIn(tool, tenantID, idempotencyKey string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, ef := range s.effects {
		if ef.Tool == tool && ef.TenantID == tenantID && ef.IdempotencyKey == idempotencyKey && !ef.Replay {
			n++
		}
	}
	return n
}

// Duplicates returns, sorted, every (tool, tenant, key) whose side effect
// was applied more than once, formatted "<tool>:<tenant_id>/<idempotency_key>".
// Reads and replays do not count. An exactly-once run returns none.
func (s *Server) Duplicates() []string {
	return DuplicatesOf(s.Effects())
}

// DuplicatesOf is Duplicates over any list of effects, such as one read back
// with ReadJournal from several processes.
func DuplicatesOf(effects []Effect) []string {
	counts := make(map[string]int)
	for _, ef := range effects {
		if ef.Replay || ef.Read {
			continue
		}
		counts[ef.Tool+":"+ef.TenantID+"/"+ef.IdempotencyKey]++
	}
	var out []string
	for k, n := range counts {
		if n > 1 {
			out = append(out, k)
		}
	}
	sort.Strings(out)
	return out
}

// Requests returns how many requests reached a tool route (POST
// /tools/{tool} and status lookups), whatever their outcome.
func (s *Server) Requests() int64 { return s.requests.Load() }

// ReadJournal reads the effects a Server appended to path (Config.
// JournalPath), possibly from several processes. A last line without a
// newline is a write in progress and is skipped.
func ReadJournal(path string) ([]Effect, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read journal: %w", err)
	}
	if i := bytes.LastIndexByte(b, '\n'); i != len(b)-1 {
		b = b[:i+1]
	}
	var out []Effect
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for line := 1; sc.Scan(); line++ {
		if len(sc.Bytes()) == 0 {
			continue
		}
		var ef Effect
		if err := json.Unmarshal(sc.Bytes(), &ef); err != nil {
			return nil, fmt.Errorf("journal %s line %d: %v", path, line, err)
		}
		out = append(out, ef)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("scan journal %s: %v", path, err)
	}
	return out, nil
}
