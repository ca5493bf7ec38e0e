// Package failpoint names the steps of the ledger's processors where a
// crash is most dangerous, so that the reliability suite can kill a
// processor exactly there and count what happened at the far side.
//
// Processors take a Hook in their configuration and call it at each step;
// a nil Hook does nothing, which is what every production build has. The
// hook that crashes the process (FromEnv) is compiled in only under the
// build tag `failpoints`: a binary built without it cannot be told to
// kill itself, whatever its environment says.
package failpoint

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Name is a step of a processor at which a crash can be injected.
type Name string

// The failpoints. The loop's three are hit by every processor that runs on
// ledger.Loop (the intake and the executor); the rest by the executor and
// its store and tool client.
const (
	// Consumed: a batch of records was polled; nothing of it is done.
	Consumed Name = "consumed"
	// Produced: the batch's events were produced into the open
	// transaction; EndTxn was not sent.
	Produced Name = "produced"
	// Committed: EndTxn committed the transaction, and the process never
	// learns it (the "EndTxn response lost" case, from the process's side).
	Committed Name = "committed"
	// ClaimSent: the claim's statements were sent to the store (on
	// PostgreSQL with their COMMIT, in one round trip), and no answer
	// was read: the claim may or may not have committed.
	ClaimSent Name = "claim-sent"
	// Claimed: the claims are committed in the store; no tool was called.
	Claimed Name = "claimed"
	// ToolApplied: the tool answered (its effect is applied), and the
	// answer is lost with the process before it is read.
	ToolApplied Name = "tool-applied"
	// ResponseReceived: the tools' answers are in hand; the results are
	// not written to the store.
	ResponseReceived Name = "response-received"
	// ResultWritten: the results are committed in the store; their events
	// are not produced.
	ResultWritten Name = "result-written"
)

// All lists every failpoint, in the order a call meets them.
var All = []Name{Consumed, ClaimSent, Claimed, ToolApplied, ResponseReceived, ResultWritten, Produced, Committed}

// Hook is called at each failpoint a processor passes. A nil Hook does
// nothing.
type Hook func(Name)

// Hit calls h with n, if h is set.
func (h Hook) Hit(n Name) {
	if h != nil {
		h(n)
	}
}

// EnvSpec is the environment variable that arms failpoints in a binary
// built with the `failpoints` tag: a comma-separated list of
// `role.point=probability` (or `point=probability` for every role), for
// example `executor.claimed=0.02,consumed=0.01`.
const EnvSpec = "LEDGER_FAILPOINTS"

// EnvLog is the environment variable naming the file that a crashing
// process appends one line to (`role point pid unix-nanoseconds`) just
// before it kills itself, so the suite can count the crashes per point.
const EnvLog = "LEDGER_FAILPOINT_LOG"

// Spec is a parsed EnvSpec: the probability of a crash at each point, per
// role ("" for every role).
type Spec map[string]map[Name]float64

// ParseSpec parses an EnvSpec value.
func ParseSpec(s string) (Spec, error) {
	spec := Spec{}
	for item := range strings.SplitSeq(s, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		lhs, p, ok := strings.Cut(item, "=")
		if !ok {
			return nil, fmt.Errorf("failpoint %q: want point=probability", item)
		}
		prob, err := strconv.ParseFloat(p, 64)
		if err != nil || prob < 0 || prob > 1 {
			return nil, fmt.Errorf("failpoint %q: probability must be a number in [0, 1]", item)
		}
		role, point := "", lhs
		if i := strings.LastIndexByte(lhs, '.'); i >= 0 {
			role, point = lhs[:i], lhs[i+1:]
		}
		if !slices.Contains(All, Name(point)) {
			return nil, fmt.Errorf("failpoint %q: unknown point %q (known: %s)", item, point, names())
		}
		if spec[role] == nil {
			spec[role] = map[Name]float64{}
		}
		spec[role][Name(point)] = prob
	}
	return spec, nil
}

// For returns the probabilities that apply to role: its own, over those
// given for every role.
func (s Spec) For(role string) map[Name]float64 {
	out := map[Name]float64{}
	for n, p := range s[""] {
		out[n] = p
	}
	for n, p := range s[role] {
		out[n] = p
	}
	return out
}

func names() string {
	s := make([]string, len(All))
	for i, n := range All {
		s[i] = string(n)
	}
	return strings.Join(s, ", ")
}
