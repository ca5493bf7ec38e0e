package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/ledger/token"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/projections/httpapi"
	"github.com/toolcall-ledger/ledger/projections/report"
	"github.com/toolcall-ledger/ledger/schemas"
	"github.com/toolcall-ledger/ledger/statemachine"
)

type submitFlags struct {
	file        string
	tool        string
	toolVersion int
	args        string
	tenant      string
	user        string
	key         string
	callID      string
	traceID     string
	deadline    time.Duration
	wait        bool
	timeout     time.Duration
	retryLater  int
	jsonOut     bool
	assertion   string
	dataDir     string
	api         string

	// userSet: --user was given (or LEDGER_USER), not left at its
	// default.
	userSet bool
}

func newSubmitCmd(g *globals) *cobra.Command {
	var f submitFlags
	cmd := &cobra.Command{
		Use:   "submit",
		Short: "Publish a tool-call envelope to the request topic, or through the ledger's API with --api (from flags, a file, or stdin)",
		Example: `  ledger submit --tool get_weather --args '{"city":"Sydney"}' --tenant t_demo --wait
  ledger submit --file envelope.json
  cat envelope.json | ledger submit --file - --wait
  ledger submit --api https://ledger.example.com --assertion "$(cat token)" --tool get_weather --args '{"city":"Oslo"}' --tenant t_acme --wait`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runSubmit(cmd, g, &f)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&f.file, "file", "", "read the envelope from this file ('-' for stdin) instead of building it from flags; it is sent as is")
	fs.StringVar(&f.tool, "tool", "", "tool name")
	fs.IntVar(&f.toolVersion, "tool-version", 1, "tool version")
	fs.StringVar(&f.args, "args", "{}", "tool arguments as a JSON object")
	fs.StringVar(&f.tenant, "tenant", "t_demo", "tenant id; with --assertion and no --tenant, the assertion's")
	fs.StringVar(&f.user, "user", "u_demo", "user id (a claim; the verified assertion decides); with --assertion and no --user, the scope claims none, and the ledger takes the assertion's")
	fs.StringVar(&f.key, "key", "", "idempotency key (default: a random one; reuse it to retry the same call)")
	fs.StringVar(&f.callID, "call-id", "", "call id (default: random)")
	fs.StringVar(&f.traceID, "trace-id", "", "trace id")
	fs.DurationVar(&f.deadline, "deadline", 30*time.Second, "how long the call may take before it is no longer wanted (0: none)")
	fs.BoolVar(&f.wait, "wait", false, "wait for the call to settle and print its last event (the exit status is 0 however it settles, refused, denied or failed included: read its state from what is printed, or --json's type; 1 if it does not settle within --timeout)")
	fs.DurationVar(&f.timeout, "timeout", 60*time.Second, "how long --wait waits")
	fs.IntVar(&f.retryLater, "retry-later", 3, "with --wait: how many times to send the envelope again, same key, after a refusal for now (rate_limited, policy_timeout, policy_unavailable) once the wait it names has passed, if its answer can come within --timeout (0: never)")
	fs.BoolVar(&f.jsonOut, "json", false, "print the envelope / final event as JSON only")
	fs.StringVar(&f.assertion, "assertion", "", "the agent's identity assertion (a JWT from your identity provider) of an envelope built from the flags; default: $"+agentAssertionEnv+", else one minted by the dev issuer in --data-dir (without either, submit refuses to send: the ledger would refuse the call). Not with --file, whose envelope is sent as is. Never LEDGER_ASSERTION, the staff commands' variable: an approver's or operator's assertion is refused, since it would be published in the request topic")
	// LEDGER_ASSERTION is the staff commands' (approvals, control,
	// calls): a shell set for them holds an operator's token, which
	// submit would publish for every reader of the request topic.
	markExplicitOnly(fs, "assertion")
	fs.StringVar(&f.dataDir, "data-dir", devDataDir, "data directory of 'ledger dev', whose dev issuer signs the assertion when --assertion is empty")
	// dev takes its directory from its command line alone: so does
	// whatever finds dev's issuer in it.
	ignoreEnv(fs, "data-dir")
	fs.StringVar(&f.api, "api", "", "submit through this ledger API ('ledger api', e.g. https://ledger.example.com) instead of Kafka, with the envelope's assertion as the bearer: --wait then reads the call back from the API, with its result (for the call's own user), and needs no access to Kafka; --json prints the call as the API answers it, or the refusal that answered this submission")
	return cmd
}

// agentAssertionEnv is the variable submit takes an agent's assertion
// from when --assertion is not given.
const agentAssertionEnv = "LEDGER_AGENT_ASSERTION"

// staffAssertion refuses an assertion (read unverified: the sender's
// own) that names the staff's audience (identity.ApproverAudience, or
// $LEDGER_STAFF_AUDIENCE): an approver's or operator's, which the intake
// refuses, and which published would stay in the request topic for the
// topic's retention, usable by its every reader until it expires.
func staffAssertion(assertion string) error {
	var claims struct {
		Audience token.Audience `json:"aud"`
	}
	if assertion == "" || token.Unverified(assertion, &claims) != nil {
		return nil // the intake refuses what cannot be read
	}
	staff := []string{identity.ApproverAudience}
	if a := os.Getenv("LEDGER_STAFF_AUDIENCE"); a != "" {
		staff = append(staff, a)
	}
	for _, aud := range claims.Audience {
		if slices.Contains(staff, aud) {
			return fmt.Errorf("the assertion names the staff's audience %q: it is an approver's or operator's, which the intake refuses, and submit would publish it in the request topic for the topic's readers to use; nothing was sent: pass an agent's assertion (--assertion, or %s)", report.Printable(aud), agentAssertionEnv)
		}
	}
	return nil
}

func randomID(prefix string) string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// envelopeFlags build an envelope; --file sends its own.
var envelopeFlags = []string{"tool", "tool-version", "args", "tenant", "user", "key", "call-id", "trace-id", "deadline", "assertion"}

func runSubmit(cmd *cobra.Command, g *globals, f *submitFlags) error {
	ctx := cmd.Context()
	out := cmd.OutOrStdout()
	if f.retryLater < 0 {
		return fmt.Errorf("--retry-later %d: must not be negative", f.retryLater)
	}
	if f.file != "" {
		// Each was ignored: the call then went as the file has it (its
		// key, its deadline, its assertion), and a --wait could print
		// an earlier call's outcome under the file's key.
		var given []string
		for _, name := range envelopeFlags {
			if cmd.Flags().Changed(name) {
				given = append(given, "--"+name)
			}
		}
		if len(given) > 0 {
			return fmt.Errorf("%s: for an envelope built from the flags; --file's envelope is sent as is, with its own", strings.Join(given, ", "))
		}
	}
	var body []byte
	var key ledger.CallKey
	var callID string
	keyless := false // --file's envelope names no key the intake can read
	if f.file != "" {
		var err error
		if f.file == "-" {
			body, err = io.ReadAll(cmd.InOrStdin())
		} else {
			body, err = os.ReadFile(f.file)
		}
		if err != nil {
			return fmt.Errorf("read envelope: %w", err)
		}
		var env struct {
			Assertion string `json:"assertion"`
		}
		if json.Unmarshal(body, &env) == nil {
			if err := staffAssertion(env.Assertion); err != nil {
				return fmt.Errorf("--file %s: %w", f.file, err)
			}
		}
		k, id, ok := ledger.LenientKey(body)
		if !ok && f.wait {
			why := "no scope.tenant_id and idempotency_key that can be read (a tenant id, and a key of 1 to 255 printable ASCII characters, neither . nor ..)"
			if !json.Valid(body) {
				why = "not JSON"
			}
			return fmt.Errorf("--file %s: %s: the intake would put it on the DLQ, where --wait cannot follow it; without --wait it is published as is (ledger dlq shows it there)", f.file, why)
		}
		keyless = !ok
		key, callID = k, id
	} else {
		if f.key != "" && !schemas.ValidIdempotencyKey(f.key) {
			return fmt.Errorf("--key %q: an idempotency key is 1 to 255 printable ASCII characters, neither first nor last a space, and neither . nor ..", report.Printable(f.key))
		}
		given := func(name string) bool { return flagGiven(cmd.Flags(), name) }
		f.userSet = given("user")
		if f.assertion == "" {
			f.assertion = os.Getenv(agentAssertionEnv)
		}
		if err := staffAssertion(f.assertion); err != nil {
			return err
		}
		// The intake refuses a scope's tenant other than the
		// assertion's, and the schema wants one: a --assertion without
		// --tenant is of the tenant it names (read unverified: the
		// sender's own token).
		if f.assertion != "" && !given("tenant") {
			var claims struct {
				Tenant string `json:"tenant"`
			}
			if token.Unverified(f.assertion, &claims) == nil && schemas.ValidTenantID(claims.Tenant) {
				f.tenant = claims.Tenant
			}
		}
		var err error
		if body, err = f.envelope(); err != nil {
			return err
		}
		key, callID = ledger.CallKey{TenantID: f.tenant, IdempotencyKey: f.key}, f.callID
		// As the intake reads it: a tenant or a call id it cannot
		// read would put the envelope on the DLQ, where no event
		// answers it (a --wait ran to its timeout, saying nothing
		// happened).
		if k, id, ok := ledger.LenientKey(body); !ok || k != key || id != callID {
			return fmt.Errorf("--tenant %q, --call-id %q: the intake reads neither a tenant id with a / nor one longer than 128 characters, nor a call id longer than 255, and would put the envelope on the DLQ; nothing was published", report.Printable(f.tenant), report.Printable(callID))
		}
	}

	logger := g.logger()
	if f.api != "" {
		return submitThroughAPI(ctx, g, logger, f, body, key, callID, out)
	}
	cc := g.kafka.client(logger)
	pub, err := newPublisher(cc, g.kafka.requests)
	if err != nil {
		return err
	}
	defer pub.Close()
	publish := func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		defer cancel()
		if err := pub.Publish(ctx, []byte(key.String()), body); err != nil {
			return fmt.Errorf("publish to %s: %w", g.kafka.requests, err)
		}
		return nil
	}
	var w *callWait
	if f.wait {
		// Before the envelope goes out: what is in the log by then
		// answered an earlier one.
		if w, err = newCallWait(ctx, cc, g.kafka.events, key, callID, body); err != nil {
			return err
		}
		w.requests = g.kafka.requests
	}
	if w != nil {
		w.lastSent = time.Now()
	}
	if err := publish(ctx); err != nil {
		return err
	}
	switch {
	case f.jsonOut:
	case keyless:
		fmt.Fprintf(out, "published an envelope with no key that can be read (not JSON, or no valid scope.tenant_id and idempotency_key) to %s: the intake puts it on the DLQ (%s; ledger dlq --since 5m shows why)\n", g.kafka.requests, g.kafka.dlq)
	default:
		fmt.Fprintf(out, "published %s (call_id %s) to %s\n", key, callID, g.kafka.requests)
	}
	if !f.wait {
		if f.jsonOut {
			printEnvelope(out, body)
		}
		return nil
	}
	return w.run(ctx, f, out, publish)
}

// callWait follows a submitted call until it settles or is refused, and
// sends its envelope again after refusals for now (--retry-later).
type callWait struct {
	cc    ledger.ClientConfig
	topic string
	// requests is the topic the envelope went to, for the timeout's
	// message.
	requests string
	callID   string
	digest   string // of the envelope as published (httpapi.RefusalOf)
	// callKey is the key the call lives under: the verified tenant's,
	// which is the claimed one unless the scope lies. keys are every key
	// its events may come under, callKey first, and ends where each
	// key's partition ended before the envelope first went out: each key
	// is followed from there, as an event below is no answer to this
	// submission (a refusal of an earlier one with the same call id).
	callKey ledger.CallKey
	keys    []ledger.CallKey
	ends    []int64
	// own tells this submission's call from others under the key: a
	// call with other arguments or of another user (its requested event
	// says) is an earlier one, whose outcome is no answer to this
	// submission, which is refused.
	own httpapi.OwnCallOf

	mu sync.Mutex
	// The call followed is that of the first requested event of this
	// submission's read under callKey (placed), or of a later one read
	// live that is newer: start is that event (its call id, event id and
	// time), live whether it was read live, call its events
	// folded in seq order (ahead holds those read before the ones they
	// follow), and unplaced the events read before any such requested
	// event. earlier says a requested event of another call came first
	// (other arguments, another user): an earlier one under the key,
	// whose outcome is no answer to this submission.
	placed   bool
	start    ledger.Event
	live     bool
	call     statemachine.Call
	folded   ledger.Event // the last event folded
	ahead    map[int64]heldEvent
	unplaced []heldEvent
	earlier  bool
	last     *ledger.Event // the settling event, or the refusal that ends the wait
	forNow   *ledger.Event // the last refusal for now answered by sending again
	sent     int           // envelopes published
	lastSent time.Time     // when the last one was: set as the first goes out
	retried  int           // refusals for now answered by sending again
	refusals map[string]bool
	// The call's events below ends[0], for a call sent before (a resend,
	// which the intake answers with no event), are read backwards
	// (ledger.CallBefore) as the keys are followed from their ends, and
	// folded with them. histFrom is the offset the read had got down to,
	// for the timeout's message.
	histDone bool
	histFrom int64
	histErr  error
	// refusedAt is when a refusal of this submission was made, read
	// live: the key was free then, so the read back need go no further
	// than a call placed live would need. news is closed once that, or
	// such a call, is known (knowFloor).
	refusedAt time.Time
	news      chan struct{}
	newsSent  bool
}

// heldEvent is an event of the call under callKey not folded yet, and
// whether it was read past where the key's partition ended before the
// envelope first went out.
type heldEvent struct {
	e     ledger.Event
	fresh bool
}

func newCallWait(ctx context.Context, cc ledger.ClientConfig, topic string, key ledger.CallKey, callID string, body []byte) (*callWait, error) {
	w := &callWait{cc: cc, topic: topic, callID: callID, digest: ledger.RequestDigest(body), callKey: key, sent: 1, refusals: make(map[string]bool)}
	sent := readSent(body)
	w.own = sent.own()
	if sent.tenant != "" {
		w.callKey.TenantID = sent.tenant
	}
	w.keys = []ledger.CallKey{w.callKey}
	if w.callKey != key {
		w.keys = append(w.keys, key)
	}
	// A refusal before the sender was verified is filed under the
	// reserved tenant.
	w.keys = append(w.keys, ledger.CallKey{TenantID: ledger.UnverifiedTenant, IdempotencyKey: key.IdempotencyKey})
	var err error
	if w.ends, err = ledger.EndOffsets(ctx, cc, topic, w.keys...); err != nil {
		return nil, fmt.Errorf("read where %s ends: %w", topic, err)
	}
	return w, nil
}

// run follows the call's keys until it settles, is refused for good, or
// --timeout passes, and prints the outcome. A refusal for now is answered
// by publishing the envelope again once its wait has passed, if the
// answer to that can come within --timeout (twice the time the last one
// took).
func (w *callWait) run(ctx context.Context, f *submitFlags, out io.Writer, publish func(context.Context) error) error {
	waitEnd := w.lastSent.Add(f.timeout)
	wctx, cancel := context.WithDeadline(ctx, waitEnd)
	defer cancel()
	// again carries the wait before the envelope goes out again; one
	// resend is pending at most, as its refusal comes first.
	again := make(chan time.Duration, 1)
	var (
		wg   sync.WaitGroup
		errs = make([]error, len(w.keys))
	)
	w.histFrom = w.ends[0]
	w.news = make(chan struct{})
	wg.Go(func() {
		// A call placed on a requested event read live needs nothing
		// read back from before its own time, nor does a submission
		// refused with its key free. The intake's answer, which says
		// so, is given a moment after the first window: without it the
		// read would go on doubling its windows until it came.
		first := true
		floor := func() time.Time {
			if first {
				first = false
				t := time.NewTimer(historyGrace)
				select {
				case <-w.news:
				case <-t.C:
				case <-wctx.Done():
				}
				t.Stop()
			}
			w.mu.Lock()
			defer w.mu.Unlock()
			if w.live {
				return w.start.At
			}
			return w.refusedAt
		}
		evs, err := ledger.CallBefore(wctx, w.cc, w.topic, w.callKey, w.ends[0], floor, func(offset int64) {
			w.mu.Lock()
			w.histFrom = offset
			w.mu.Unlock()
		})
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.last != nil || wctx.Err() != nil {
			return
		}
		if err != nil {
			// Said if nothing else ends the wait: a call begun after the
			// envelope went out needs none of it.
			w.histErr = fmt.Errorf("read the call's earlier events: %w", err)
			return
		}
		w.histDone = true
		// All of it, before asking whether the call settled: a call
		// approved and run since has approval_pending among its events.
		for _, e := range evs {
			w.take(e, false, f, out)
		}
		w.settled(cancel)
	})
	for i, k := range w.keys {
		wg.Go(func() {
			// Owned by this command: ends when the call settles or wctx
			// ends.
			errs[i] = ledger.FollowCall(wctx, w.cc, w.topic, k, w.ends[i], func(e ledger.Event, _ int64) bool {
				w.mu.Lock()
				defer w.mu.Unlock()
				if w.last != nil {
					return true
				}
				if e.Refusal() {
					return w.refused(e, f, out, waitEnd, again, cancel)
				}
				if k != w.callKey {
					return false
				}
				w.take(e, true, f, out)
				return w.settled(cancel)
			})
			if i == 0 && errs[i] != nil && wctx.Err() == nil {
				// The call's own key: said at once, not when --timeout
				// runs out. (A record under another key that does not
				// decode is never this call's.)
				cancel()
			}
		})
	}
	followed := make(chan struct{})
	go func() {
		wg.Wait()
		close(followed)
	}()
	var (
		resendErr    error
		resendFailed bool
	)
	for resending := true; resending; {
		select {
		case <-followed:
			resending = false
		case wait := <-again:
			if resendErr != nil {
				continue // the wait is ending: nothing goes out again
			}
			t := time.NewTimer(wait)
			select {
			case <-t.C:
				now := time.Now()
				if resendErr = publish(wctx); resendErr != nil {
					// Said as it is, unless --timeout ran out meanwhile.
					resendFailed = wctx.Err() == nil
					cancel()
					break
				}
				w.mu.Lock()
				w.sent, w.lastSent = w.sent+1, now
				w.mu.Unlock()
			case <-followed:
				t.Stop()
				resending = false
			}
		}
	}
	// The followers have returned: nothing writes w any more.
	if w.last == nil {
		if resendFailed {
			return resendErr
		}
		// The followers' own failures: each ends its follower alone,
		// and the rest run out with wctx, which is no failure of theirs.
		// The read back's is said only where the call's state is not:
		// a call read live needs none of it.
		var failed []error
		for _, err := range errs {
			if err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
				failed = append(failed, err)
			}
		}
		if len(failed) > 0 {
			return errors.Join(failed...)
		}
		if w.histErr != nil && !w.placed && !w.earlier {
			return w.histErr
		}
		if r := w.forNow; r != nil && !w.placed {
			return fmt.Errorf("call %s did not settle within %s: sent %d time(s), its last answer a refusal for now (%s, retry after %s)",
				w.callKey, f.timeout, w.sent, report.Printable(r.Reason), time.Duration(r.RetryAfterMS)*time.Millisecond)
		}
		if w.call.State == "" && !w.earlier {
			if !w.histDone {
				// Nothing answered this submission, and a call sent
				// before (which the intake answers with no event) was
				// not found: its partition is long, or no intake runs.
				return fmt.Errorf("call %s did not settle within %s: no event of it was read. Either nothing answered it (is an intake running, reading %s?), or it was sent before and its earlier events lie further back than --timeout let be read: its partition of %s, which ended at offset %d when the envelope went out, had been read back to offset %d (a longer --timeout, or --api, whose lookups are the projection's)",
					w.callKey, f.timeout, w.requests, w.topic, w.ends[0], w.histFrom)
			}
			return fmt.Errorf("call %s did not settle within %s: no event of it was read, before this submission or after it (is an intake running, reading %s?)",
				w.callKey, f.timeout, w.requests)
		}
		return fmt.Errorf("call %s did not settle within %s (state %q)", w.callKey, f.timeout, w.call.State)
	}
	last := w.last
	if f.jsonOut {
		return printJSONTo(out, last)
	}
	if last.Refusal() {
		printRefusal(out, f, *last, w.sent)
		return nil
	}
	fmt.Fprintf(out, "%s is %s\n", w.callKey, w.call.State)
	return nil
}

// historyGrace is how long the read back of a call's earlier events
// waits, after its first window, for the intake's answer to say how far
// back it need go (a call begun live, a refusal of this submission); a
// resend, which gets no answer, pays it once.
const historyGrace = time.Second

// knowFloor notes that the read back need go no further than a window
// before a time now known (a call placed live, a refusal read live).
// Under w.mu.
func (w *callWait) knowFloor() {
	if w.news != nil && !w.newsSent {
		w.newsSent = true
		close(w.news)
	}
}

// take folds an event of a call under callKey, fresh when it was read
// past where the key's partition ended before the envelope first went
// out. Under w.mu. The events of the call read back and of those read
// live come in any order, and the log itself holds copies of a call's
// first events after the ones that follow them (an outbox appended
// again): they are folded in seq order, each once, as the call of the
// first requested event of this submission places them. Whether the
// call settled is asked after (settled): after each event read live,
// after all of those read back.
func (w *callWait) take(e ledger.Event, fresh bool, f *submitFlags, out io.Writer) {
	h := heldEvent{e, fresh}
	switch {
	case e.Type == statemachine.EventRequested && !w.own.Is(e):
		// Another's call under the key, which this submission's
		// refusal answers; unless one of its own comes after.
		w.earlier = w.earlier || !w.placed
	case e.Type == statemachine.EventRequested && (!w.placed || fresh && e.EventID != w.start.EventID && e.At.After(w.start.At)):
		// The call's start; or, read live, a newer call's than the one
		// placed (the store lost the key, and admitted it again), not a
		// copy of it, which shares its event id.
		w.placed, w.start, w.live, w.earlier = true, e, fresh, false
		w.call, w.ahead = statemachine.Call{}, nil
		if fresh {
			w.knowFloor()
		}
		w.fold(h, f, out)
		waiting := w.unplaced
		w.unplaced = nil
		for _, u := range waiting {
			if u.e.CallID == w.start.CallID {
				w.fold(u, f, out)
			}
		}
	case !w.placed:
		w.unplaced = append(w.unplaced, h)
	case e.CallID != w.start.CallID:
	case e.At.Before(w.start.At.Add(-ledger.CopySkew)):
		// Under the call's id, but dated before it: an earlier call's
		// (the same envelope sent before, the store having lost the
		// key since).
	default:
		w.fold(h, f, out)
	}
}

// settled ends the wait if the call folded so far settled, on the last
// event folded. Under w.mu.
func (w *callWait) settled(cancel func()) bool {
	if w.last == nil && w.call.State.Settled() {
		e := w.folded
		w.last = &e
		cancel()
	}
	return w.last != nil
}

// fold applies h's event to the call if it is the next by seq, and then
// those held ahead that follow it, and prints each; an event past the
// next is held ahead, and one applied already (a copy) dropped. Under
// w.mu.
func (w *callWait) fold(h heldEvent, f *submitFlags, out io.Writer) {
	switch {
	case h.e.Seq <= w.call.Seq:
		return
	case h.e.Seq > w.call.Seq+1:
		if w.ahead == nil {
			w.ahead = make(map[int64]heldEvent)
		}
		if _, ok := w.ahead[h.e.Seq]; !ok {
			w.ahead[h.e.Seq] = h
		}
		return
	}
	for {
		next, _, err := statemachine.Apply(w.call, h.e.Transition())
		if err != nil {
			return
		}
		w.call, w.folded = next, h.e
		if h.fresh {
			w.forNow = nil // a sending was admitted
		}
		if !f.jsonOut {
			printEvent(out, h.e)
		}
		n, ok := w.call.Seq+1, false
		if h, ok = w.ahead[n]; !ok {
			return
		}
		delete(w.ahead, n)
	}
}

// refused takes a refusal of the call's id read under a key after the
// envelope first went out, and reports whether the wait is over. Under
// w.mu. A refusal for now is answered by sending the envelope again (on
// again) while --retry-later allows and the answer can come within
// --timeout; any other refusal of this submission ends the wait.
// Refusals of an earlier submission, and one read twice (an event id
// seen), are passed over.
func (w *callWait) refused(e ledger.Event, f *submitFlags, out io.Writer, waitEnd time.Time, again chan<- time.Duration, cancel func()) bool {
	if !httpapi.RefusalOf(e, w.callID, w.digest) || (e.EventID != "" && w.refusals[e.EventID]) {
		return false
	}
	if e.Reason == intake.ReasonRateLimited && w.refusedAt.IsZero() {
		// Charged with the admission, once the key was found free: no
		// call stood under it, then.
		w.refusedAt = e.At
		w.knowFloor()
	}
	w.refusals[e.EventID] = true
	if wait, ok := sendAgain(e, f, w.retried, w.lastSent, waitEnd); ok {
		w.retried++
		w.forNow = &e
		printSendAgain(out, f, e, wait, w.retried)
		select {
		case again <- wait:
		default:
		}
		return false
	}
	w.last = &e
	cancel()
	return true
}

// envelope builds the envelope the flags describe, filling in random ids
// and computing the arguments hash.
func (f *submitFlags) envelope() ([]byte, error) {
	if f.tool == "" {
		return nil, errors.New("--tool is required (or --file)")
	}
	args, err := ledger.Decode([]byte(f.args), ledger.Limits{})
	if err != nil {
		return nil, fmt.Errorf("--args: %w", err)
	}
	if f.key == "" {
		f.key = randomID("key_")
	}
	if f.callID == "" {
		f.callID = randomID("call_")
	}
	hash, err := ledger.ArgumentsHash(f.tenant, f.tool, f.toolVersion, args)
	if err != nil {
		return nil, fmt.Errorf("--args: %w", err)
	}
	scope := map[string]string{"tenant_id": f.tenant}
	// The intake refuses a scope's user other than the assertion's
	// (scope_mismatch): a default one would refuse every --assertion of
	// another user. Left out, the assertion's is taken.
	if f.userSet || f.assertion == "" {
		scope["user_id"] = f.user
	}
	env := map[string]any{
		"tool":            f.tool,
		"tool_version":    f.toolVersion,
		"call_id":         f.callID,
		"arguments":       json.RawMessage(f.args),
		"scope":           scope,
		"idempotency_key": f.key,
		"arguments_hash":  hash,
	}
	if f.traceID != "" {
		env["trace_id"] = f.traceID
	}
	assertion := f.assertion
	if assertion == "" {
		// Sent without one, the call would only be refused
		// (assertion_missing) once it reached the ledger.
		if assertion, err = devAssertion(f.dataDir, f.tenant, f.user); err != nil {
			return nil, fmt.Errorf("no identity assertion: pass --assertion (a JWT from your identity provider) or set "+agentAssertionEnv+", or give the --data-dir of the ledger dev whose issuer mints one: %w", err)
		}
	}
	env["assertion"] = assertion
	if f.deadline > 0 {
		env["deadline_ms"] = f.deadline.Milliseconds()
	}
	return json.Marshal(env)
}

// sentEnvelope is what the sender of an envelope knows of it: its
// assertion's claims are read without verifying them (it is the
// submitter's own token), only to know under which tenant the ledger
// will record the call, and whose.
type sentEnvelope struct {
	assertion, argumentsHash, scopeUser string
	// tenant and user are the assertion's: "" when it names none (or a
	// tenant no key can be under).
	tenant, user string
}

func readSent(body []byte) sentEnvelope {
	var env struct {
		Assertion     string `json:"assertion"`
		ArgumentsHash string `json:"arguments_hash"`
		Scope         struct {
			UserID string `json:"user_id"`
		} `json:"scope"`
	}
	if json.Unmarshal(body, &env) != nil {
		return sentEnvelope{}
	}
	s := sentEnvelope{assertion: env.Assertion, argumentsHash: env.ArgumentsHash, scopeUser: env.Scope.UserID}
	var claims struct {
		Tenant string `json:"tenant"`
		Sub    string `json:"sub"`
	}
	if token.Unverified(env.Assertion, &claims) == nil {
		s.user = claims.Sub
		if !strings.Contains(claims.Tenant, "/") {
			s.tenant = claims.Tenant
		}
	}
	return s
}

// own tells the envelope's call from others under its key.
func (s sentEnvelope) own() httpapi.OwnCallOf {
	return httpapi.OwnCall(s.argumentsHash, s.scopeUser, s.user)
}

// submitThroughAPI submits body through the ledger API at --api, with the
// envelope's assertion as the bearer, and with --wait reads the call back
// from it until it settles, this submission is refused, or --timeout
// passes. A refusal for now is answered by submitting again, as through
// Kafka (--retry-later); refusals already under the key before the first
// submission are an earlier one's, and passed over.
func submitThroughAPI(ctx context.Context, g *globals, logger *slog.Logger, f *submitFlags, body []byte, key ledger.CallKey, callID string, out io.Writer) error {
	if err := checkAssertionURL(f.api); err != nil {
		return err
	}
	env := readSent(body)
	own := env.own()
	if env.assertion == "" {
		return errors.New("--api needs the envelope's identity assertion (--assertion or " + agentAssertionEnv + ", a dev issuer in --data-dir, or in the --file envelope): the API takes it as the bearer")
	}
	hc, err := g.httpClient.client(logger, 0)
	if err != nil {
		return err
	}
	cl := &httpapi.AgentClient{Base: f.api, HTTP: hc}
	end := time.Now().Add(f.timeout)
	wctx, cancel := context.WithDeadline(ctx, end)
	defer cancel()
	// seen: refusals that are no answer, an earlier submission's or one
	// answered by sending again.
	seen := map[string]bool{}
	// notBefore: refusals dated before the last sending (by more than
	// the clocks' skew) are taken for earlier ones, as the API does,
	// whether or not those under the key could be read before: a
	// projection behind may show one only after this submission.
	var notBefore time.Time
	if f.wait {
		pctx, cancel := context.WithTimeout(wctx, 5*time.Second)
		if v, err := cl.Call(pctx, key, env.assertion); err == nil {
			for _, r := range v.Refusals {
				seen[r.EventID] = true
			}
		}
		cancel()
	}
	var lastSent time.Time
	// The API holds a wait 30 s at most; the rest is polled.
	submit := func() (httpapi.CallView, error) {
		lastSent = time.Now()
		notBefore = lastSent.Add(-httpapi.RefusalSkew)
		wait := time.Duration(0)
		if f.wait {
			wait = min(time.Until(end), 30*time.Second)
		}
		// Its own bound, past --timeout: the submission must be
		// answered even when the wait ran out.
		sctx, cancel := context.WithTimeout(ctx, wait+15*time.Second)
		defer cancel()
		v, _, err := cl.Submit(sctx, body, env.assertion, wait)
		return v, err
	}
	view, err := submit()
	if err != nil {
		return fmt.Errorf("submit through %s: %w", f.api, err)
	}
	if !f.jsonOut {
		fmt.Fprintf(out, "published %s (call_id %s) through %s\n", key, callID, f.api)
	}
	if !f.wait {
		if f.jsonOut {
			printEnvelope(out, body)
		}
		return nil
	}
	sent, retried := 1, 0
	every := 100 * time.Millisecond
	var lastErr error // the last read that failed for now, for the timeout's message
	for {
		if refusal := answeringRefusal(view, callID, ledger.RequestDigest(body), seen, notBefore); refusal != nil {
			seen[refusal.EventID] = true
			if wait, ok := sendAgain(*refusal, f, retried, lastSent, end); ok {
				retried++
				printSendAgain(out, f, *refusal, wait, retried)
				select {
				case <-wctx.Done():
				case <-time.After(wait):
				}
				if wctx.Err() != nil {
					return fmt.Errorf("call %s did not settle within %s: sent %d time(s), its last answer a refusal for now (%s)", key, f.timeout, sent, report.Printable(refusal.Reason))
				}
				v, err := submit()
				for err != nil && httpapi.IsTransient(err) && wctx.Err() == nil {
					select {
					case <-wctx.Done():
					case <-time.After(time.Second):
						v, err = submit()
					}
				}
				if err != nil {
					return fmt.Errorf("submit through %s again: %w", f.api, err)
				}
				view = v
				sent++
				continue
			}
			return printAPICall(out, f, view, refusal, sent)
		}
		// A call settled with other arguments, or another user's, is an
		// earlier one under the key: this submission's answer is its
		// refusal, to come.
		if req, _ := view.Requested(); view.Settled && own.Is(req) {
			return printAPICall(out, f, view, nil, sent)
		}
		select {
		case <-wctx.Done():
			why := ""
			switch {
			case lastErr != nil:
				why = "; the API's last answer: " + lastErr.Error()
			case view.State == "":
				// Refusals of the assertion itself are filed under the
				// ledger's own tenant, which the API does not show.
				why = "; the API shows no call under the key: one refused before its assertion was verified (expired, revoked) is not shown there (ledger trace, or submit through Kafka)"
			}
			return fmt.Errorf("call %s did not settle within %s (state %q): sent %d time(s)%s", key, f.timeout, report.Printable(view.State), sent, why)
		case <-time.After(every):
		}
		every = min(2*every, time.Second)
		v, err := cl.Call(wctx, key, env.assertion)
		switch {
		case err == nil:
			view, lastErr = v, nil
		case httpapi.IsNotFound(err), wctx.Err() != nil:
			// Not projected yet: asked again. Or the wait is over,
			// said above.
		case httpapi.IsTransient(err):
			lastErr = err // the API busy or unreachable for now
		default:
			return fmt.Errorf("read call %s from %s: %w", key, f.api, err)
		}
	}
}

// answeringRefusal is the refusal of this submission's envelope (its call
// id, its bytes' digest: httpapi.RefusalOf) that answers it: the one the
// API's wait ended on, else the first in v not seen; neither dated before
// notBefore.
func answeringRefusal(v httpapi.CallView, callID, digest string, seen map[string]bool, notBefore time.Time) *ledger.Event {
	if r := v.Refused; r != nil && httpapi.RefusalOf(*r, callID, digest) && !seen[r.EventID] && !r.At.Before(notBefore) {
		// Checked here too: an older API's wait ends on any refusal
		// of the call id.
		return r
	}
	for i, r := range v.Refusals {
		if httpapi.RefusalOf(r, callID, digest) && !seen[r.EventID] && !r.At.Before(notBefore) {
			return &v.Refusals[i]
		}
	}
	return nil
}

// printAPICall prints the call, or the refusal that ended the wait, as
// the API answered it; --json prints the call, or the refusal, as JSON.
func printAPICall(out io.Writer, f *submitFlags, v httpapi.CallView, refusal *ledger.Event, sent int) error {
	if f.jsonOut {
		if refusal != nil {
			return printJSONTo(out, refusal)
		}
		return printJSONTo(out, v)
	}
	if refusal != nil {
		printRefusal(out, f, *refusal, sent)
		return nil
	}
	for _, e := range v.Events {
		printEvent(out, e)
	}
	fmt.Fprintf(out, "%s is %s\n", report.Printable(v.TenantID+"/"+v.IdempotencyKey), report.Printable(v.State))
	switch {
	case len(v.Result) > 0:
		fmt.Fprintf(out, "result (untrusted content from the tool): %s\n", report.Printable(string(compactJSON(v.Result))))
	case v.ResultWithheld != "":
		fmt.Fprintf(out, "result withheld: %s\n", report.Printable(v.ResultWithheld))
	}
	return nil
}

// sendAgain says whether a refusal e is answered by sending the envelope
// again, after wait: a refusal for now, while --retry-later allows
// (retried so far) and the answer can come before end (twice the time
// the last sending, at lastSent, took).
func sendAgain(e ledger.Event, f *submitFlags, retried int, lastSent, end time.Time) (wait time.Duration, ok bool) {
	wait = time.Duration(e.RetryAfterMS) * time.Millisecond
	now := time.Now()
	return wait, wait > 0 && retried < f.retryLater && now.Add(wait+2*now.Sub(lastSent)).Before(end)
}

// printSendAgain says that the envelope goes out again after wait, the
// retried-th time.
func printSendAgain(out io.Writer, f *submitFlags, e ledger.Event, wait time.Duration, retried int) {
	if !f.jsonOut {
		fmt.Fprintf(out, "  refused for now: %s; sending again in %s (%d of %d)\n", report.Printable(e.Reason), wait, retried, f.retryLater)
	}
}

// printEvent prints one of the call's events on a line.
func printEvent(out io.Writer, e ledger.Event) {
	fmt.Fprintf(out, "  seq %d  %-16s %s\n", e.Seq, report.Printable(string(e.Type)), report.EventNote(e))
}

// printRefusal prints the refusal that ended a wait, after sent
// submissions.
func printRefusal(out io.Writer, f *submitFlags, e ledger.Event, sent int) {
	// A refusal of the call as a whole (a rate limit, a frozen tool)
	// points at no field of the envelope.
	at := ""
	if e.Pointer != "" {
		at = " at " + report.Printable(e.Pointer)
	}
	fmt.Fprintf(out, "refused: %s%s: %s\n", report.Printable(e.Reason), at, report.Printable(e.Detail))
	if e.RetryAfterMS > 0 {
		fmt.Fprintf(out, "  the ledger asks for a retry after %s; sent %d time(s) (--retry-later %d, --timeout %s)\n",
			time.Duration(e.RetryAfterMS)*time.Millisecond, sent, f.retryLater, f.timeout)
	}
}

// compactJSON is raw on one line.
func compactJSON(raw json.RawMessage) []byte {
	var b bytes.Buffer
	if json.Compact(&b, raw) != nil {
		return raw
	}
	return b.Bytes()
}

// checkAssertionURL refuses an --api the CLI would send an identity
// assertion to in clear: http is for loopback only. An assertion is a
// bearer credential, and whoever reads it on the way acts as its holder
// until it expires (an operator's freezes, an approver's approvals).
func checkAssertionURL(api string) error {
	if err := credentials.CheckURL(api, false); err != nil {
		return fmt.Errorf("--api %s: %w (the request carries an identity assertion)", api, err)
	}
	return nil
}

// printEnvelope prints the envelope published, its assertion (a bearer
// credential, of the agent's identity provider) redacted: --json output
// goes to job logs and files.
func printEnvelope(out io.Writer, body []byte) {
	fmt.Fprintf(out, "%s\n", ledger.RedactTokens(body))
}
