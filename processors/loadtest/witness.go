package loadtest

import (
	"fmt"
	"time"

	"github.com/toolcall-ledger/ledger/processors/demobackend"
)

// Witness is what the tool backend saw of a run: the count of effects
// where they happen, so that "exactly once" is checked at the tool and not
// in the ledger's own tables.
type Witness struct {
	// Effects are new side effects (writes).
	Effects int64 `json:"effects"`
	// Reads are requests to read-only tools.
	Reads int64 `json:"reads"`
	// Replays are native replays: the tool answered a repeated key from
	// its record, with no new effect.
	Replays int64 `json:"replays"`
	// Duplicates are calls with more than one new side effect: must be 0.
	Duplicates int64 `json:"duplicate_effects"`
	// DuplicateSends are calls of a tool with effects (not a read) one of
	// whose attempts reached the tool more than once under one claim
	// (its credential, jti and iat, when the backend verifies
	// credentials: a call keeps its jti, each claim mints anew): must
	// be 0. The ledger's adapter never sends a request again, and a retry
	// is an attempt of a higher number, so one sent twice is the executor
	// sending it twice, which a tool that deduplicates by key
	// (create_ticket, refund_order) absorbs, and Duplicates cannot see. A
	// takeover of a native call after its lease expired sends the same
	// attempt again under a new claim, as it may: not counted.
	DuplicateSends int64 `json:"duplicate_sends"`
	// Missing are calls the ledger reported succeeded that the tool never
	// saw: must be 0.
	Missing int64 `json:"missing_effects"`
	// Orphans are calls the tool saw that the ledger did not report
	// succeeded (lost, failed after the tool ran, or still in flight).
	Orphans int64 `json:"orphan_effects"`
}

// Failures names what w shows went wrong at the tool, in a run named
// name: duplicate effects, attempts sent twice, successes without an
// effect. Empty when nothing did.
func (w Witness) Failures(name string) []string {
	var bad []string
	if w.Duplicates > 0 {
		bad = append(bad, fmt.Sprintf("%s: %d duplicate effects", name, w.Duplicates))
	}
	if w.DuplicateSends > 0 {
		bad = append(bad, fmt.Sprintf("%s: %d calls with an attempt sent to the tool twice", name, w.DuplicateSends))
	}
	if w.Missing > 0 {
		bad = append(bad, fmt.Sprintf("%s: %d calls succeeded without an effect at the tool", name, w.Missing))
	}
	return bad
}

// Check counts the run's effects among those the backend applied.
func Check(res Result, effects []demobackend.Effect) Witness {
	var w Witness
	seen := make(map[int64]int64) // call -> new effects (reads count as one)
	type send struct {
		call    int64
		attempt int
		jti     string
		issued  time.Time
	}
	sent := make(map[send]int)
	twice := make(map[int64]bool) // calls counted in DuplicateSends
	for _, ef := range effects {
		i, ok := callIndex(ef.IdempotencyKey, res.RunID)
		if !ok {
			continue
		}
		if !ef.Read && ef.Attempt > 0 {
			k := send{i, ef.Attempt, ef.JTI, ef.CredentialIssued}
			if sent[k]++; sent[k] == 2 && !twice[i] {
				twice[i] = true
				w.DuplicateSends++
			}
		}
		switch {
		case ef.Read:
			w.Reads++
			if _, ok := seen[i]; !ok {
				seen[i] = 0
			}
		case ef.Replay:
			w.Replays++
			if _, ok := seen[i]; !ok {
				seen[i] = 0
			}
		default:
			w.Effects++
			seen[i]++
		}
	}
	for i, n := range seen {
		if n > 1 {
			w.Duplicates++
		}
		if !res.Succeeded(i) {
			w.Orphans++
		}
	}
	for wi, word := range res.succeeded {
		for b := range 64 {
			if word&(1<<b) == 0 {
				continue
			}
			if _, ok := seen[int64(wi*64+b)]; !ok {
				w.Missing++
			}
		}
	}
	return w
}

// Succeeded reports whether call i of the run succeeded.
func (r Result) Succeeded(i int64) bool {
	w := int(i / 64)
	return i >= 0 && w < len(r.succeeded) && r.succeeded[w]&(1<<(i%64)) != 0
}
