// Package intake is the ledger's front door: it turns raw envelopes from the
// request topic into the first events of a call, or into a refusal, or (for
// records that cannot even be read) into a DLQ record with the reason.
// Nothing it reads is dropped silently.
package intake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
	"github.com/toolcall-ledger/ledger/schemas"
	"github.com/toolcall-ledger/ledger/statemachine"
)

// Reasons the intake gives, beyond the decoder's codes (ledger.Code*).
const (
	ReasonHashMismatch        = "arguments_hash_mismatch"
	ReasonUnknownTool         = "unknown_tool"
	ReasonUnknownToolVersion  = "unknown_tool_version"
	ReasonInvalidArguments    = "invalid_arguments"
	ReasonNoPolicy            = "no_policy"
	ReasonIdempotencyKeyReuse = "idempotency_key_reused"
	ReasonUnidentifiable      = "unidentifiable_request"
)

// Store is the part of the execution store the intake uses.
type Store interface {
	Admit(ctx context.Context, as []processors.Admission) ([]processors.AdmitResult, error)
	MarkLogged(ctx context.Context, ls []processors.Logged) error
}

// Config configures the intake.
type Config struct {
	// Registry of tools. Required.
	Registry *schemas.Registry
	// Store records each call on first sight. Required.
	Store Store
	// Topics; defaults as ledger.Topics.
	Topics ledger.Topics
	// Limits on envelopes; defaults 256 KiB and depth 32.
	Limits ledger.Limits
	// Actor names this instance in events; default "intake".
	Actor string
	// Now is the clock; default time.Now.
	Now func() time.Time
	// Logger; nil discards.
	Logger *slog.Logger
}

// Processor is the intake. It holds no per-call state: everything it needs
// to know about earlier envelopes is in the store.
type Processor struct {
	cfg Config
}

// New validates cfg and returns an intake.
func New(cfg Config) (*Processor, error) {
	if cfg.Registry == nil || cfg.Store == nil {
		return nil, errors.New("intake: registry and store are required")
	}
	cfg.Topics = cfg.Topics.WithDefaults()
	cfg.Limits = cfg.Limits.WithDefaults()
	if cfg.Actor == "" {
		cfg.Actor = "intake"
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Processor{cfg: cfg}, nil
}

// pending is one envelope that passed every check that needs no state and
// now waits for the store to say whether its key is free.
type pending struct {
	env       *ledger.Envelope
	admission processors.Admission
}

// Step handles one batch of request records: it is a ledger.Step.
func (p *Processor) Step(ctx context.Context, recs []*kgo.Record) (ledger.Output, error) {
	var (
		out     []*kgo.Record
		admits  []pending
		emitErr error
	)
	emit := func(evs ...ledger.Event) {
		for i := range evs {
			r, err := evs[i].Record(p.cfg.Topics.Events)
			if err != nil {
				emitErr = err
				return
			}
			out = append(out, r)
		}
	}
	now := p.cfg.Now().UTC()
	for _, rec := range recs {
		env, refusal, dlq := p.check(rec, now)
		switch {
		case dlq != nil:
			out = append(out, dlq)
		case refusal != nil:
			emit(*refusal)
		default:
			a, err := p.admission(env, now)
			if err != nil {
				return ledger.Output{}, err
			}
			admits = append(admits, pending{env: env, admission: a})
		}
	}
	if len(admits) == 0 {
		return ledger.Output{Records: out}, emitErr
	}

	as := make([]processors.Admission, len(admits))
	for i := range admits {
		as[i] = admits[i].admission
	}
	results, err := p.cfg.Store.Admit(ctx, as)
	if err != nil {
		return ledger.Output{}, fmt.Errorf("admit %d calls: %w", len(as), err)
	}
	var logged []processors.Logged
	// A key's events go out once per batch, however many copies of its
	// envelope the batch holds.
	emitted := make(map[ledger.CallKey]bool)
	for i, res := range results {
		a := admits[i]
		switch res.Outcome {
		case processors.Admitted:
			emitted[a.admission.Key] = true
			evs, err := ledger.DecodeEvents(a.admission.Outbox)
			if err != nil {
				return ledger.Output{}, err
			}
			emit(evs...)
			logged = append(logged, processors.Logged{Key: a.admission.Key, Seq: a.admission.Seq})
		case processors.Duplicate:
			// A retry of a call we already hold. Its events are in
			// the log unless a crash came between the store and the
			// log; then they go out again and readers drop the
			// duplicate (key, seq).
			if res.Record.Unlogged() && !emitted[a.admission.Key] {
				emitted[a.admission.Key] = true
				evs, err := ledger.DecodeEvents(res.Record.Outbox)
				if err != nil {
					return ledger.Output{}, err
				}
				for _, e := range evs {
					if e.Seq > res.Record.LoggedSeq {
						emit(e)
					}
				}
				logged = append(logged, processors.Logged{Key: res.Record.Key, Seq: res.Record.Seq})
			} else {
				p.cfg.Logger.Debug("duplicate envelope", "call_key", a.admission.Key.String())
			}
		case processors.Conflict:
			emit(p.refuse(a.env.Key(), a.env, now, ReasonIdempotencyKeyReuse, "/arguments_hash",
				"the idempotency key is already used by a call with other arguments"))
		default:
			return ledger.Output{}, fmt.Errorf("admit %s: unexpected outcome %d", a.admission.Key, res.Outcome)
		}
	}
	committed := func(ctx context.Context) error {
		if len(logged) == 0 {
			return nil
		}
		return p.cfg.Store.MarkLogged(ctx, logged)
	}
	return ledger.Output{Records: out, Committed: committed}, emitErr
}

// check runs every check that needs no state. It returns the envelope, or a
// refusal event, or a DLQ record.
func (p *Processor) check(rec *kgo.Record, now time.Time) (*ledger.Envelope, *ledger.Event, *kgo.Record) {
	env, err := ledger.DecodeEnvelope(rec.Value, p.cfg.Limits)
	if err != nil {
		var de *ledger.DecodeError
		if !errors.As(err, &de) {
			de = &ledger.DecodeError{Code: ledger.CodeInvalidJSON, Detail: err.Error()}
		}
		key, callID, ok := ledger.LenientKey(rec.Value)
		if !ok {
			p.cfg.Logger.Warn("request to dlq", "topic", rec.Topic, "partition", rec.Partition, "offset", rec.Offset, "reason", de.Code)
			return nil, nil, ledger.DLQRecord(p.cfg.Topics.DLQ, rec, de.Code, de.Error())
		}
		ev := p.refuse(key, &ledger.Envelope{CallID: callID}, now, de.Code, de.Pointer, de.Detail)
		return nil, &ev, nil
	}
	hash, err := ledger.ArgumentsHash(env.Scope.TenantID, env.Tool, env.ToolVersion, env.Arguments)
	if err != nil {
		var de *ledger.DecodeError
		code, ptr := ReasonInvalidArguments, "/arguments"
		if errors.As(err, &de) {
			code, ptr = de.Code, de.Pointer
		}
		ev := p.refuse(env.Key(), env, now, code, ptr, err.Error())
		return nil, &ev, nil
	}
	if hash != env.ArgumentsHash {
		ev := p.refuse(env.Key(), env, now, ReasonHashMismatch, "/arguments_hash",
			"arguments_hash is not the sha256 of the canonical (RFC 8785) {arguments, tenant_id, tool, tool_version}")
		return nil, &ev, nil
	}
	tool, err := p.cfg.Registry.Lookup(env.Tool, env.ToolVersion)
	switch {
	case errors.Is(err, schemas.ErrUnknownVersion):
		ev := p.refuse(env.Key(), env, now, ReasonUnknownToolVersion, "/tool_version", err.Error())
		return nil, &ev, nil
	case err != nil:
		ev := p.refuse(env.Key(), env, now, ReasonUnknownTool, "/tool", err.Error())
		return nil, &ev, nil
	}
	if err := tool.Validate(env.Arguments); err != nil {
		var ve *schemas.ValidationError
		ptr, detail := "/arguments", err.Error()
		if errors.As(err, &ve) {
			ptr, detail = "/arguments"+ve.Pointer, ve.Reason
		}
		ev := p.refuse(env.Key(), env, now, ReasonInvalidArguments, ptr, detail)
		return nil, &ev, nil
	}
	return env, nil, nil
}

// admission decides a checked envelope and builds its record: the events
// the call starts with go into the outbox.
func (p *Processor) admission(env *ledger.Envelope, now time.Time) (processors.Admission, error) {
	tool, err := p.cfg.Registry.Lookup(env.Tool, env.ToolVersion)
	if err != nil {
		return processors.Admission{}, err
	}
	args, err := ledger.Canonical(env.Arguments)
	if err != nil {
		return processors.Admission{}, err
	}
	redacted, err := ledger.Canonical(ledger.Redact(env.Arguments, tool.Redact))
	if err != nil {
		return processors.Admission{}, err
	}
	deadline := env.Deadline(now)
	requested := p.event(env, now, statemachine.EventRequested, 1)
	requested.Arguments = json.RawMessage(redacted)
	if !deadline.IsZero() {
		requested.DeadlineAt = &deadline
	}

	decision := p.event(env, now, statemachine.EventAuthorized, 2)
	status := processors.StatusAuthorized
	// Until policies exist the decision fails closed: only low-risk
	// tools run.
	if tool.Risk == schemas.RiskLow {
		decision.Decision = "allow"
		decision.Reason = "low_risk"
	} else {
		decision.Type = statemachine.EventDenied
		decision.Decision = "deny"
		decision.Reason = ReasonNoPolicy
		decision.Detail = fmt.Sprintf("no policy allows %s risk tool %s", tool.Risk, tool.Name)
		status = processors.StatusDenied
	}
	outbox, err := ledger.EncodeEvents([]ledger.Event{requested, decision})
	if err != nil {
		return processors.Admission{}, err
	}
	return processors.Admission{
		Key:           env.Key(),
		CallID:        env.CallID,
		ArgumentsHash: env.ArgumentsHash,
		Tool:          env.Tool,
		ToolVersion:   env.ToolVersion,
		Arguments:     args,
		DeadlineAt:    deadline,
		Status:        status,
		Seq:           2,
		Outbox:        outbox,
	}, nil
}

// event returns an event of the call env describes.
func (p *Processor) event(env *ledger.Envelope, now time.Time, t statemachine.EventType, seq int64) ledger.Event {
	return ledger.Event{
		EventID:        newEventID(),
		Type:           t,
		Seq:            seq,
		At:             now,
		Actor:          p.cfg.Actor,
		TenantID:       env.Scope.TenantID,
		IdempotencyKey: env.IdempotencyKey,
		CallID:         env.CallID,
		UserID:         env.Scope.UserID,
		Tool:           env.Tool,
		ToolVersion:    env.ToolVersion,
		ArgumentsHash:  env.ArgumentsHash,
		TraceID:        env.TraceID,
	}
}

// refuse records a refused submission: one denied event at seq 0, under the
// key the envelope named, that leaves any call under that key untouched.
func (p *Processor) refuse(key ledger.CallKey, env *ledger.Envelope, now time.Time, reason, pointer, detail string) ledger.Event {
	ev := p.event(env, now, statemachine.EventDenied, 0)
	ev.TenantID, ev.IdempotencyKey = key.TenantID, key.IdempotencyKey
	ev.Decision = "deny"
	ev.Reason = reason
	ev.Pointer = pointer
	ev.Detail = detail
	return ev
}

func newEventID() string {
	// NewV7 fails only if the system's random source does.
	return uuid.Must(uuid.NewV7()).String()
}

// Loop returns the intake on a consume-process-produce loop. lc's Group
// defaults to "ledger-intake", its Topics to the request topic, and its
// TransactionalID to "<group>-" + the actor.
func (p *Processor) Loop(lc ledger.LoopConfig) (*ledger.Loop, error) {
	if lc.Group == "" {
		lc.Group = "ledger-intake"
	}
	if len(lc.Topics) == 0 {
		lc.Topics = []string{p.cfg.Topics.Requests}
	}
	if lc.TransactionalID == "" {
		lc.TransactionalID = lc.Group + "-" + p.cfg.Actor
	}
	if lc.Logger == nil {
		lc.Logger = p.cfg.Logger
	}
	return ledger.NewLoop(lc, p.Step)
}
