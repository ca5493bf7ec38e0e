package policy

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cedar-policy/cedar-go"
)

// Reasons a Decision gives (Decision.Reason).
const (
	// ReasonAllowed: at least one permit matched and no forbid did.
	ReasonAllowed = "allowed"
	// ReasonDeniedByPolicy: a forbid matched.
	ReasonDeniedByPolicy = "denied_by_policy"
	// ReasonNoPolicy: no permit matched (Cedar's default deny).
	ReasonNoPolicy = "no_policy"
	// ReasonPolicyError: a policy failed to evaluate (or evaluation
	// panicked); the engine fails closed.
	ReasonPolicyError = "policy_error"
	// ReasonPolicyTimeout: evaluation did not finish within
	// Config.Timeout, or before the caller's context ended.
	ReasonPolicyTimeout = "policy_timeout"
	// ReasonCrossTenant: the resource belongs to another tenant than the
	// caller. Decided before any policy runs.
	ReasonCrossTenant = "cross_tenant"
	// ReasonUnavailable: no policy set is active, such as while the
	// version activated on the control plane does not load, or its files
	// are not the content the activation pins.
	ReasonUnavailable = "policy_unavailable"
	// ReasonInvalidRequest: the request lacks a tenant, user or tool, or
	// names a tenant the model cannot express.
	ReasonInvalidRequest = "invalid_request"
	// ReasonSandboxUnavailable: the deciding permits ask for the call to
	// run against a sandbox backend (@sandbox), and the ledger runs no
	// call against one: run against the real backend, the call would
	// escape the rule.
	ReasonSandboxUnavailable = "sandbox_unavailable"
)

// DefaultTimeout is Config.Timeout's default.
const DefaultTimeout = 50 * time.Millisecond

// Decision is the engine's answer. Every reason but ReasonAllowed has
// Allow false.
type Decision struct {
	Allow bool
	// Reason is one of the Reason* constants.
	Reason string
	// PolicyIDs are the deciding policies, sorted: the permits that
	// matched when allowed, the forbids that matched when denied by
	// policy, the policies that failed on policy_error. Empty otherwise.
	PolicyIDs []string
	// Version is the Set.Version that decided; empty only when no set
	// was active.
	Version string
	// Obligations come from the annotations of the matching permits
	// only; a denial carries none.
	Obligations Obligations
	// AuditMask lists the fields that any policy of the deciding set
	// masks (@mask) for the request's tool, sorted: the audit copy of
	// the call's arguments hides them whatever the decision, denials
	// included, where Obligations.Mask (what the result hides) holds
	// only the deciding permits'. It includes Obligations.Mask. Empty
	// only when no set was active or no policy masks anything for the
	// tool.
	AuditMask []string
	// Detail is for humans: which rule failed and why. It never holds
	// argument values.
	Detail string
	// Roles are the caller's roles the policies were given, sorted:
	// empty when they were given none (RolesGiven false) or the caller
	// has none. RolesGiven says whether the principal had the roles
	// attribute: Config.Roles, unless the request withheld them
	// (Request.RolesWithheld). The call's events carry both.
	Roles      []string
	RolesGiven bool
}

// Transient reports whether d denies only because the engine could not
// decide in time or had no set to decide with (policy_timeout,
// policy_unavailable): it says nothing about the call, and asking again
// later (after a stall, an activated set) may answer. Callers fail closed
// for now but not for good: nothing runs on such a decision, and nothing
// records it as the call's final denial. Every other denial stands: the
// policies' own answers (a forbid, no matching permit, another tenant's
// resource, an invalid request) and an evaluation error (policy_error),
// which a policy that cannot evaluate this call's request (a missing
// attribute, a type error) gives every time it is asked.
func (d Decision) Transient() bool {
	switch d.Reason {
	case ReasonPolicyTimeout, ReasonUnavailable:
		return !d.Allow
	}
	return false
}

// Config configures an Engine.
type Config struct {
	// Set is the policy set active from the start. Nil is allowed: every
	// decision denies (policy_unavailable) until Swap or Reload.
	Set *Set
	// Timeout bounds one evaluation; a late decision is a denial
	// (policy_timeout) whatever Cedar said. Default DefaultTimeout; it
	// must not be negative. A shorter deadline on Decide's context wins.
	Timeout time.Duration
	// Now is the clock the timeout is measured with, and the decision
	// time of a Request without Time. Default time.Now.
	Now func() time.Time
	// Logger receives evaluation failures and reloads; nil discards.
	Logger *slog.Logger
	// Roles gives the policies the caller's roles (Request.Roles), as
	// the principal's attribute roles, and records them on the decision
	// (Decision.Roles), whence on the call's events, which the executor
	// decides an approved call again with. Events that carry roles are of
	// encoding version 2, which builds before it refuse: turn it on once
	// every process of the deployment reads version 2. Off, the principal
	// has no roles attribute, so that a policy that reads it fails closed
	// (policy_error) rather than see no roles.
	Roles bool
}

// Engine is the policy decision point: it holds the active Set and decides
// requests against it. It is safe for concurrent use; Swap and Reload take
// effect for the next Decide, and a Decide in flight finishes on the set it
// started with.
//
// Two sources change the active set at run time: the policy directory
// (Reload, WatchDir), which gives the base set, and the version an
// operator activated on the control plane (FollowActivations), which wins
// over the base for as long as it is in force.
type Engine struct {
	cfg    Config
	active atomic.Pointer[Set]
	// failed is why the activated version is not in force, nil when it
	// is or none is activated; read by Decide and Err without mu.
	failed atomic.Pointer[activationError]
	// hook, when set (tests only), runs before each policy is evaluated.
	hook func(id cedar.PolicyID)

	// mu orders the changes that the directory and the activations make
	// to the active set, so that whichever runs last, an activation in
	// force is never replaced by the directory's set.
	mu sync.Mutex
	// base is the set in force while no version is activated:
	// Config.Set, then the directory's latest content that loaded.
	base *Set
	// pinned is the label of the activated version in force (loaded or
	// not), empty while none is; pinnedID the activation's ID and
	// pinnedHash the content it pins.
	pinned, pinnedID, pinnedHash string
}

// Activation is a policy version activated on the control plane: its
// label, and an ID that tells two activations of one label apart (the
// control record's time). Activating a label again reads its files again:
// an operator who mended a version's files and activated it anew gets the
// mended set on every instance, not only on those that start afterwards.
type Activation struct {
	Label string
	ID    string
	// Hash, when set, pins the version's content (Set.Hash): an instance
	// whose files under the label hash otherwise does not decide with
	// them, and fails closed as for files that do not load, until they
	// match.
	Hash string
}

// activationError is why a version activated on the control plane is not
// in force.
type activationError struct {
	label string
	err   error
	// at is when it was loaded and failed: the same activation is not
	// read again before activationRetry has passed.
	at time.Time
}

// activationRetry is how often an activation that failed to load is read
// again: a caller bringing the engine to the activation at every step
// (intake.Config.SyncPolicies) would otherwise read and parse the
// version's files at every one for as long as it fails.
const activationRetry = 500 * time.Millisecond

func (e *activationError) Error() string {
	var pe *pinError
	if errors.As(e.err, &pe) {
		return fmt.Sprintf("activated policy version %q is not the content the activation pins: %v", e.label, e.err)
	}
	return fmt.Sprintf("activated policy version %q does not load: %v", e.label, e.err)
}

// pinError: the files under an activated label are not the content the
// activation pins (not yet rolled out to this instance, or changed since).
type pinError struct{ files, pinned string }

func (e *pinError) Error() string {
	return fmt.Sprintf("its files hash to %s, not to the pinned %s", e.files, e.pinned)
}

func (e *activationError) Unwrap() error { return e.err }

// NewEngine validates cfg and returns an engine.
func NewEngine(cfg Config) (*Engine, error) {
	if cfg.Timeout < 0 {
		return nil, fmt.Errorf("policy: negative timeout %v", cfg.Timeout)
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	e := &Engine{cfg: cfg, base: cfg.Set}
	if cfg.Set != nil {
		e.active.Store(cfg.Set)
	}
	return e, nil
}

// Active returns the active set, nil when there is none.
func (e *Engine) Active() *Set { return e.active.Load() }

// Err says why every decision is denied (policy_unavailable), nil while a
// set is active: the version activated on the control plane does not load
// or is not the content the activation pins (FollowActivations; the error
// then names both hashes), or the engine never had a set. It is what a
// readiness check reports.
func (e *Engine) Err() error {
	if e.active.Load() != nil {
		return nil
	}
	if f := e.failed.Load(); f != nil {
		return f
	}
	return errors.New("no policy set is active")
}

// Swap makes s the active set for the next Decide and returns the set it
// replaces. A nil s makes every decision deny (policy_unavailable). It is
// the low-level switch: it neither changes the base set nor ends an
// activation, and a later change by WatchDir or FollowActivations follows
// their rules again.
func (e *Engine) Swap(s *Set) *Set {
	old := e.active.Swap(s)
	e.cfg.Logger.Info("policy set activated", "policy_version", s.Version(), "previous_version", old.Version())
	return old
}

// Reload loads dir as a set labelled label and makes it the base set,
// active unless a version activated on the control plane is in force
// (FollowActivations), which wins. If the files do not load, the sets
// stay and the error is returned. Loading the files of the base set again
// changes nothing.
func (e *Engine) Reload(dir, label string) error {
	files, err := readFiles(os.DirFS(dir))
	if err != nil {
		return fmt.Errorf("reload policies from %s: %w", dir, err)
	}
	_, err = e.reload(files, label)
	if err != nil {
		return fmt.Errorf("reload policies from %s: %w", dir, err)
	}
	return nil
}

// reload makes files the base set unless they are already, and activates
// it unless an activated version is in force. It is compared with the
// base, not the active set: under an activation the two differ for good,
// and the directory must not take over again at every poll.
func (e *Engine) reload(files []file, label string) (bool, error) {
	hash := hashFiles(files)
	e.mu.Lock()
	defer e.mu.Unlock()
	if b := e.base; b != nil && b.hash == hash && b.label == label {
		return false, nil
	}
	s, err := parse(files, label, hash)
	if err != nil {
		return false, err
	}
	e.base = s
	if e.pinned != "" {
		e.cfg.Logger.Info("policy directory changed; an activated version is in force and stays",
			"policy_version", s.Version(), "activated_label", e.pinned)
		return true, nil
	}
	e.Swap(s)
	return true, nil
}

// WatchDir reloads dir every interval (as Reload) until ctx ends, then
// returns nil. It blocks: run it in a goroutine its caller owns, such as an
// errgroup's. A change is loaded once the directory reads the same on two
// polls in a row, so that a file caught while being written (truncated,
// then filled) is not activated half-written; writing a file elsewhere and
// renaming it in is still the safe way. A directory that fails to load is
// logged once per distinct content and leaves the active set in place.
// While a version activated on the control plane is in force, a change
// only becomes the base set, in force again once the activation ends.
func (e *Engine) WatchDir(ctx context.Context, dir, label string, every time.Duration) error {
	if every <= 0 {
		return fmt.Errorf("policy: watch interval must be positive, got %v", every)
	}
	t := time.NewTicker(every)
	defer t.Stop()
	fsys := os.DirFS(dir)
	var (
		failed string // hash of the last content that failed, to log it once
		w      settle
	)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		files, err := readFiles(fsys)
		if err != nil {
			if msg := err.Error(); msg != failed {
				failed = msg
				e.cfg.Logger.Error("policy reload failed", "dir", dir, "error", err)
			}
			continue
		}
		hash := hashFiles(files)
		if hash == failed || !w.settled(hash) {
			continue
		}
		if _, err := e.reload(files, label); err != nil {
			failed = hash
			e.cfg.Logger.Error("policy reload failed", "dir", dir, "policy_hash", hash,
				"active_version", e.active.Load().Version(), "error", err)
			continue
		}
		failed = ""
	}
}

// settle tells when a directory's content has held still for a poll.
type settle struct{ last string }

// settled records this poll's hash and reports whether the previous poll
// saw the same.
func (w *settle) settled(hash string) bool {
	same := w.last == hash
	w.last = hash
	return same
}

// Decide evaluates r against the active set. It never fails open: no set,
// an invalid or cross-tenant request, an evaluation error, a panic or a
// late answer are all denials with their own reason. Every decision taken
// under a set carries the set's AuditMask for r's tool.
func (e *Engine) Decide(ctx context.Context, r Request) Decision {
	s := e.active.Load()
	if s == nil {
		detail := "no policy set is active"
		if f := e.failed.Load(); f != nil {
			// Not the load error itself: the detail reaches the agent.
			detail = fmt.Sprintf("activated policy version %q does not load", f.label)
			var pe *pinError
			if errors.As(f.err, &pe) {
				detail = fmt.Sprintf("activated policy version %q is not the content the activation pins", f.label)
			}
		}
		return Decision{Reason: ReasonUnavailable, Detail: detail}
	}
	// From here RolesWithheld says whether the principal lacks the
	// roles attribute.
	r.RolesWithheld = !e.cfg.Roles || r.RolesWithheld
	if r.RolesWithheld {
		r.Roles = nil
	} else {
		// Sorted and without duplicates: the decision records the set
		// the policies saw, in one spelling.
		r.Roles = slices.Compact(slices.Sorted(slices.Values(r.Roles)))
	}
	d := e.decide(ctx, s, r)
	d.AuditMask = s.auditMask(r.Tool)
	if len(r.AuditAlso) > 0 {
		for _, t := range r.AuditAlso {
			d.AuditMask = append(d.AuditMask, s.auditMask(t)...)
		}
		slices.Sort(d.AuditMask)
		d.AuditMask = slices.Compact(d.AuditMask)
	}
	d.Roles, d.RolesGiven = r.Roles, !r.RolesWithheld
	return d
}

// decide is Decide under the set s.
func (e *Engine) decide(ctx context.Context, s *Set, r Request) (d Decision) {
	if err := r.validate(); err != nil {
		return Decision{Reason: ReasonInvalidRequest, Version: s.Version(), Detail: err.Error()}
	}
	// The tenant guard runs before Cedar: whatever a tenant's policies
	// say, they cannot grant on another tenant's resources.
	if r.ResourceTenant != r.Tenant {
		return Decision{Reason: ReasonCrossTenant, Version: s.Version(),
			Detail: "the resource belongs to another tenant"}
	}
	defer func() {
		if p := recover(); p != nil {
			e.cfg.Logger.Error("policy evaluation panicked", "policy_version", s.Version(),
				"tool", r.Tool, "panic", fmt.Sprint(p))
			d = Decision{Reason: ReasonPolicyError, Version: s.Version(), Detail: "policy evaluation panicked"}
		}
	}()
	return e.evaluate(ctx, s, r)
}

// evaluate runs Cedar over s and maps its answer to a Decision.
func (e *Engine) evaluate(ctx context.Context, s *Set, r Request) Decision {
	start := e.cfg.Now()
	deadline := start.Add(e.cfg.Timeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	ev := &evaluation{ctx: ctx, set: s, deadline: deadline, now: e.cfg.Now, hook: e.hook}
	req, ents := cedarRequest(r, start)
	ok, diag := cedar.Authorize(ev, ents, req)
	// A policy is not interruptible, so lateness is checked again once
	// Cedar returns: an answer that came too late is not used.
	if ev.late || ev.expired() {
		e.cfg.Logger.Warn("policy evaluation timed out", "policy_version", s.Version(), "tool", r.Tool,
			"timeout", e.cfg.Timeout)
		return Decision{Reason: ReasonPolicyTimeout, Version: s.Version(),
			Detail: "policy evaluation did not finish in time"}
	}
	d := Decision{Version: s.Version()}
	if len(diag.Errors) > 0 {
		// Any error denies, even in a policy that might not have
		// mattered: a broken policy is found at once, not when it
		// happens to decide.
		//
		// Cedar's messages can quote the values they failed on (an
		// ip() or decimal() that did not parse, the operands of an
		// overflow), which are the call's arguments, masked or not:
		// the decision, which goes into events, and the warning name
		// the failing policies and where they are; the messages are
		// logged at Debug only, for a policy's author.
		where := make([]string, 0, len(diag.Errors))
		msgs := make([]string, 0, len(diag.Errors))
		for _, de := range diag.Errors {
			d.PolicyIDs = append(d.PolicyIDs, string(de.PolicyID))
			at := fmt.Sprintf("policy %s (%s:%d:%d)", de.PolicyID, de.Position.Filename, de.Position.Line, de.Position.Column)
			where = append(where, at+" could not be evaluated")
			msgs = append(msgs, at+": "+de.Message)
		}
		slices.Sort(d.PolicyIDs)
		d.PolicyIDs = slices.Compact(d.PolicyIDs)
		slices.Sort(where)
		slices.Sort(msgs)
		d.Reason = ReasonPolicyError
		d.Detail = strings.Join(where, "; ")
		e.cfg.Logger.Warn("policy evaluation failed", "policy_version", s.Version(), "tool", r.Tool,
			"policy_ids", d.PolicyIDs, "error", d.Detail)
		e.cfg.Logger.Debug("policy evaluation errors (they may quote the call's arguments)", "policy_version", s.Version(),
			"tool", r.Tool, "errors", strings.Join(msgs, "; "))
		return d
	}
	for _, reason := range diag.Reasons {
		d.PolicyIDs = append(d.PolicyIDs, string(reason.PolicyID))
	}
	slices.Sort(d.PolicyIDs)
	switch {
	case ok == cedar.Allow:
		d.Allow = true
		d.Reason = ReasonAllowed
		for _, id := range d.PolicyIDs {
			if p := s.byID[cedar.PolicyID(id)]; p != nil && p.permit {
				d.Obligations = d.Obligations.Merge(p.obligations)
			}
		}
		if d.Obligations.Sandbox {
			// Fail closed: an obligation the executor would ignore
			// weakens the rule that asked for it.
			return Decision{Reason: ReasonSandboxUnavailable, Version: s.Version(), PolicyIDs: d.PolicyIDs,
				Detail: "a sandbox backend is asked for by " + strings.Join(d.PolicyIDs, ", ") + ", and no call runs against one"}
		}
	case len(d.PolicyIDs) > 0:
		d.Reason = ReasonDeniedByPolicy
		d.Detail = "forbidden by " + strings.Join(d.PolicyIDs, ", ")
	default:
		d.Reason = ReasonNoPolicy
		d.Detail = "no policy permits " + r.Tool + " here"
	}
	return d
}

// evaluation feeds a set's policies to cedar.Authorize, checking the
// deadline between policies: Authorize takes no context, and this is
// where it can be stopped.
type evaluation struct {
	ctx      context.Context
	set      *Set
	deadline time.Time
	now      func() time.Time
	hook     func(cedar.PolicyID)
	late     bool
}

func (ev *evaluation) expired() bool {
	return ev.ctx.Err() != nil || !ev.now().Before(ev.deadline)
}

// All yields the policies until the deadline passes; it then stops and
// marks the evaluation late, which discards Cedar's partial answer.
func (ev *evaluation) All() iter.Seq2[cedar.PolicyID, *cedar.Policy] {
	return func(yield func(cedar.PolicyID, *cedar.Policy) bool) {
		for i := range ev.set.policies {
			p := &ev.set.policies[i]
			if ev.expired() {
				ev.late = true
				return
			}
			if ev.hook != nil {
				ev.hook(p.id)
			}
			if !yield(p.id, p.policy) {
				return
			}
		}
	}
}

// FollowActivations keeps the engine on the policy version that active
// names (a label, the latest control-plane activation; false while there
// is none), loading it from root/<label>, checking every interval until
// ctx ends; it returns nil then. Versions are immutable: a label in force
// is not read again.
//
// An activation wins over the base set (Config.Set, Reload, WatchDir) for
// as long as it is in force; once it is withdrawn the base set is in force
// again. An activated version that does not load (broken files, a missing
// directory, a label that is not a directory name, or no root at all), or
// whose files are not the content the activation pins (Activation.Hash),
// fails closed: the previous set is no longer the operator's policy, and
// what the new one allows is unknown, so every decision denies
// (policy_unavailable) and Err says why until it loads. It is tried again
// at every check, and logged when it fails first and when it loads.
func (e *Engine) FollowActivations(ctx context.Context, root string, active func() (Activation, bool), every time.Duration) error {
	if every <= 0 {
		every = time.Second
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		e.follow(root, active)
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// Activate brings the engine to the activation (a, ok) once, as
// FollowActivations does at every tick: a process calls it before it
// decides its first call, so that no call is decided with a set an
// operator has replaced.
func (e *Engine) Activate(root string, a Activation, ok bool) {
	e.follow(root, func() (Activation, bool) { return a, ok })
}

// Sync brings the engine to the activation active returns, once, as
// FollowActivations does at every tick; active is asked under the
// engine's lock, so that of two Syncs (or a Sync and a tick) the one
// that applies last read last: with an active that only moves forward
// (a copy of the control topic), an activation read before another was
// applied never replaces it.
func (e *Engine) Sync(root string, active func() (Activation, bool)) { e.follow(root, active) }

// follow brings the engine to the activation active returns, once; it
// asks active holding e.mu (see Sync).
func (e *Engine) follow(root string, active func() (Activation, bool)) {
	e.mu.Lock()
	defer e.mu.Unlock()
	a, ok := active()
	label := a.Label
	if !ok {
		if e.pinned == "" {
			return
		}
		e.cfg.Logger.Warn("policy activation withdrawn; the base policy set is in force again",
			"activated_label", e.pinned, "policy_version", e.base.Version())
		e.pinned, e.pinnedID, e.pinnedHash = "", "", ""
		e.failed.Store(nil)
		e.Swap(e.base)
		return
	}
	prev := e.failed.Load()
	same := label == e.pinned && a.ID == e.pinnedID && a.Hash == e.pinnedHash
	if same && (prev == nil || time.Since(prev.at) < activationRetry) {
		return
	}
	if label == e.pinned && prev == nil {
		e.cfg.Logger.Info("policy version activated again: its files are read again", "policy_label", label)
	}
	e.pinned, e.pinnedID, e.pinnedHash = label, a.ID, a.Hash
	set, err := loadVersion(root, label, a.Hash)
	if err != nil {
		f := &activationError{label: label, err: err, at: time.Now()}
		e.failed.Store(f)
		// Logged once per label and error; Err and the denials' detail
		// say it for as long as it lasts.
		if prev == nil || prev.label != label || prev.err.Error() != err.Error() {
			e.cfg.Logger.Error("activated policy version not in force; every call is denied until it is",
				"policy_label", label, "pinned_hash", a.Hash, "previous_version", e.active.Load().Version(), "err", err)
		}
		e.active.Store(nil)
		return
	}
	e.Swap(set)
	e.failed.Store(nil)
	if prev != nil && same {
		e.cfg.Logger.Info("activated policy version loaded on a retry", "policy_version", set.Version())
	}
}

// loadVersion loads the version labelled label from root/<label>; when pin
// is set, only if its files hash to pin (a *pinError otherwise), checked
// before they are parsed.
func loadVersion(root, label, pin string) (*Set, error) {
	if root == "" {
		return nil, errors.New("no policy versions directory to load it from")
	}
	if !filepath.IsLocal(label) || strings.ContainsAny(label, `/\`) {
		return nil, errors.New("the label is not a directory name")
	}
	files, err := readFiles(os.DirFS(filepath.Join(root, label)))
	if err != nil {
		return nil, err
	}
	hash := hashFiles(files)
	if pin != "" && hash != pin {
		return nil, &pinError{files: hash, pinned: pin}
	}
	return parse(files, label, hash)
}
