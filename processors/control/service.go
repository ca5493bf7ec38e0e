package control

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/identity"
)

// PlatformTenant is the tenant of a platform operator's identity: such an
// operator may act on every tenant.
const PlatformTenant = "*"

// Defaults of Config.
const (
	DefaultOperatorRole = "operator"
	DefaultApplyWait    = 2 * time.Second
	// DefaultMaxTenantSubjects is Config.MaxTenantSubjects' default: far
	// more tools and revoked families than a tenant has any use for.
	DefaultMaxTenantSubjects = 10_000
)

var (
	// ErrForbidden: the identity is not an operator, or not one who may do
	// this (another tenant's tool or family, or a jti revocation by a
	// tenant operator).
	ErrForbidden = errors.New("forbidden")
	// ErrNotFrozen: an unfreeze named a freeze that is not in force.
	ErrNotFrozen = errors.New("not frozen")
	// ErrFreezeChanged: an unfreeze named the freeze it means to lift
	// (its time), and another is in force under the subject now: frozen
	// again since the operator looked, maybe for another reason.
	ErrFreezeChanged = errors.New("freeze changed")
	// ErrNotReady: the State has not caught up with the control topic
	// yet, so the service cannot tell what is in force.
	ErrNotReady = errors.New("control state not ready")
	// ErrNotYetApplied: the action was published (it is durable and
	// every instance will apply it) but the local State had not applied
	// it within Config.ApplyWait. The Action is returned with it.
	ErrNotYetApplied = errors.New("published but not yet applied locally")
	// ErrUnknownTool: a freeze named a tool the registry does not hold
	// (Config.KnownTool), and did not say that it meant one.
	ErrUnknownTool = errors.New("unknown tool")
	// ErrActivationChanged: a withdrawal named the activation it meant
	// to end, and another was made meanwhile.
	ErrActivationChanged = errors.New("activation changed")
	// ErrNotActive: a withdrawal found no policy activation in force.
	ErrNotActive = errors.New("no policy activation in force")
	// ErrTooManySubjects: a tenant operator's action would add a subject
	// (a tool's freeze, a family's revocation) past the tenant's
	// Config.MaxTenantSubjects.
	ErrTooManySubjects = errors.New("too many control subjects for the tenant")
)

// Publisher appends records to the control topic. Implementations are
// safe for concurrent use, return once the broker acknowledged every
// record, and set each record's Partition and Offset on success, as
// franz-go's ProduceSync does: Service waits for that offset to be applied.
type Publisher interface {
	Publish(ctx context.Context, recs ...*kgo.Record) error
}

// Verifier verifies an operator's assertion. Implementations are safe for
// concurrent use; ctx bounds any key refresh.
type Verifier interface {
	Verify(ctx context.Context, assertion string) (identity.Identity, error)
}

// Inspector checks a credential's signature, issuer and expiry, and
// nothing about the request it is presented with
// (*credentials.Verifier's Inspect). A refusal is a *credentials.Error.
// Implementations are safe for concurrent use; ctx bounds any key fetch.
type Inspector interface {
	Inspect(ctx context.Context, token string) (credentials.Claims, error)
}

// Config configures a Service.
type Config struct {
	// State is the control state, run by the caller (State.Run). Required.
	State *State
	// Publisher appends to Topics.Control. Required.
	Publisher Publisher
	// Identity verifies operators' assertions for Handler. Required.
	Identity Verifier
	// Topics names the control topic; empty names take their defaults.
	// It must be the topic State.Run reads.
	Topics ledger.Topics
	// OperatorRole is the role an operator's assertion must carry.
	// Default: DefaultOperatorRole.
	OperatorRole string
	// Credentials checks tokens for the introspection endpoint. Nil: the
	// endpoint is not served.
	Credentials Inspector
	// ApplyWait bounds how long an action waits for the local State to
	// apply it after it was published. Default: DefaultApplyWait (2 s).
	ApplyWait time.Duration
	// RevocationSkew widens a family's revocation to the credentials
	// issued up to this long after it: their iat is read off the
	// executor's clock, the revocation's time off this service's, and an
	// executor whose clock runs ahead would otherwise mint credentials
	// before the revocation that seem to come after it. Default:
	// credentials.DefaultSkew (30 s), the skew verification tolerates.
	// Negative: none.
	RevocationSkew time.Duration
	// MaxStaleness is how old State may be when the introspection
	// endpoint answers (a revocation made before then is in it), and
	// when an unfreeze, or a tenant operator's freeze, is checked against
	// the freeze in force. Past it they wait up to a second for State to
	// catch up, then fail with ErrStale (503). Zero: DefaultMaxStaleness;
	// negative: not checked.
	MaxStaleness time.Duration
	// MaxTenantSubjects bounds the subjects a tenant operator's actions
	// keep on the control topic for the tenant: its tools' freezes (an
	// unfreeze stays too) and its families' revocations. Each is a record
	// kept for good, which every process of every tenant reads whole
	// before it starts, and holds: made-up tool names or key epochs in a
	// loop would otherwise stall the whole platform's starts. A platform
	// operator's actions are not bounded. Zero: DefaultMaxTenantSubjects;
	// negative: no bound.
	MaxTenantSubjects int
	// Now is the clock of Action.At. Default: time.Now.
	Now func() time.Time
	// Logger receives every published action (Info) and failures; never
	// an assertion or a token. Nil discards.
	Logger *slog.Logger
	// KnownTool reports whether the tool registry holds a tool: a freeze
	// of one it does not is refused unless asked for (FreezeUnknown).
	// Nil: any name is taken.
	KnownTool func(tool string) bool
}

func (c *Config) setDefaults() {
	c.Topics = c.Topics.WithDefaults()
	if c.OperatorRole == "" {
		c.OperatorRole = DefaultOperatorRole
	}
	if c.MaxStaleness == 0 {
		c.MaxStaleness = DefaultMaxStaleness
	}
	if c.ApplyWait == 0 {
		c.ApplyWait = DefaultApplyWait
	}
	if c.MaxTenantSubjects == 0 {
		c.MaxTenantSubjects = DefaultMaxTenantSubjects
	}
	if c.RevocationSkew == 0 {
		c.RevocationSkew = credentials.DefaultSkew
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

func (c *Config) validate() error {
	switch {
	case c.State == nil:
		return errors.New("control: no State")
	case c.Publisher == nil:
		return errors.New("control: no Publisher")
	case c.Identity == nil:
		return errors.New("control: no Identity verifier")
	case c.ApplyWait < 0:
		return errors.New("control: negative ApplyWait")
	}
	return nil
}

// Service is the operator API of the control plane: freeze and unfreeze
// tools, revoke credentials, and the token introspection endpoint. It is
// safe for concurrent use.
//
// Authorization: the operator's identity must carry Config.OperatorRole.
// A platform operator (tenant PlatformTenant, "*") may do anything. Any
// other operator acts on its own tenant only: a freeze or unfreeze without
// a tenant becomes one for the operator's tenant (it can neither freeze
// nor lift a freeze of every tenant), a freeze naming another tenant is
// forbidden, a platform operator's freeze of the operator's tenant is
// neither lifted nor replaced by it, a family revocation must name a family of the operator's
// tenant, and a jti revocation is forbidden, since a jti alone does not
// say whose credential it is. Every action needs a reason.
type Service struct {
	cfg Config
	// subjects serialize, within this service, the check of an action
	// against what is in force and its write, per subject (striped): two
	// requests checked before either's record was applied would race,
	// and every copy would pass the second over. Writes through other
	// instances still may; their records are settled on the topic
	// (State.overrulesLocked).
	subjects [64]sync.Mutex
	// unknownKeyWarned is when introspection last warned of a key not
	// known here (UnixNano): at most once a minute, since the caller's
	// word that it verified the token is not checked.
	unknownKeyWarned atomic.Int64
}

// lockSubject holds subject's stripe until the returned func.
func (s *Service) lockSubject(subject string) (unlock func()) {
	h := fnv.New32a()
	_, _ = h.Write([]byte(subject))
	m := &s.subjects[h.Sum32()%uint32(len(s.subjects))]
	m.Lock()
	return m.Unlock
}

// New returns a Service.
func New(cfg Config) (*Service, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg.Logger = cfg.Logger.With("component", "control")
	return &Service{cfg: cfg}, nil
}

// operator checks that id is an operator and reports whether it is a
// platform operator.
func (s *Service) operator(id identity.Identity) (platform bool, err error) {
	if id.User == "" || id.Tenant == "" || !slices.Contains(id.Roles, s.cfg.OperatorRole) {
		return false, fmt.Errorf("%w: the assertion does not carry the %s role", ErrForbidden, s.cfg.OperatorRole)
	}
	return id.Tenant == PlatformTenant, nil
}

// toolScope authorizes a freeze or unfreeze of tool for tenant and returns
// the tenant it applies to.
func (s *Service) toolScope(op identity.Identity, tool, tenant, reason string) (string, string, error) {
	platform, err := s.operator(op)
	if err != nil {
		return "", "", err
	}
	if reason, err = checkReason(reason); err != nil {
		return "", "", err
	}
	if err := checkTool(tool); err != nil {
		return "", "", err
	}
	if !platform {
		switch tenant {
		case "":
			tenant = op.Tenant
		case op.Tenant:
		default:
			return "", "", fmt.Errorf("%w: an operator of tenant %s may not act on tenant %s", ErrForbidden, op.Tenant, tenant)
		}
	}
	if tenant != "" {
		if err := checkTenant(tenant); err != nil {
			return "", "", err
		}
	}
	return tenant, reason, nil
}

// Freeze freezes tool, for every tenant when tenant is empty, else for
// that tenant (see Service for who may do which). Freezing again replaces
// the record (its operator and reason), except that a tenant operator
// does not replace a platform operator's freeze of its tenant
// (ErrForbidden: it is frozen already, and the replacement would be the
// tenant operator's to lift). A platform operator's freeze that replaces
// the tenant's own freeze carries it (Action.Replaced), for the platform's
// unfreeze to put back. It returns once the local State applied the
// freeze, or with ErrNotYetApplied (and the Action) after
// Config.ApplyWait.
func (s *Service) Freeze(ctx context.Context, operator identity.Identity, tool, tenant, reason string) (Action, error) {
	return s.freeze(ctx, operator, tool, tenant, reason, false)
}

// FreezeUnknown is Freeze, for a tool the registry may not hold (one only
// newer executors know, during their rollout): Freeze refuses such a
// tool (ErrUnknownTool), for a name mistyped in an incident would freeze
// nothing while the operator took it for done.
func (s *Service) FreezeUnknown(ctx context.Context, operator identity.Identity, tool, tenant, reason string) (Action, error) {
	return s.freeze(ctx, operator, tool, tenant, reason, true)
}

func (s *Service) freeze(ctx context.Context, operator identity.Identity, tool, tenant, reason string, unknown bool) (Action, error) {
	if !s.cfg.State.isReady() {
		return Action{}, ErrNotReady
	}
	tenant, reason, err := s.toolScope(operator, tool, tenant, reason)
	if err != nil {
		return Action{}, err
	}
	if !unknown && s.cfg.KnownTool != nil && !s.cfg.KnownTool(tool) {
		return Action{}, fmt.Errorf("%w: no tool %q in this control service's tool registry (its --registry-dir): check the name; to freeze a tool only newer executors know, say so (allow_unknown_tool, --unknown-tool)", ErrUnknownTool, tool)
	}
	var replaced *Action
	if operator.Tenant != PlatformTenant {
		// Checked, then written, one at a time. Not a platform
		// operator's freeze: the emergency brake waits for nobody, and
		// checks nothing that a reader does not settle (the tenant's
		// freeze it replaces is the one in force there).
		defer s.lockSubject(ToolSubject(tool, tenant))()
		if err := s.current(ctx); err != nil {
			return Action{}, err
		}
		if current, frozen := s.cfg.State.frozenExactly(tool, tenant); frozen && current.ByTenant == PlatformTenant {
			return Action{}, platformFreeze(current)
		}
		if err := s.roomFor(operator, ToolSubject(tool, tenant)); err != nil {
			return Action{}, err
		}
	} else if current, frozen := s.cfg.State.frozenExactly(tool, tenant); frozen && tenant != "" {
		// A platform operator's freeze goes out whatever this copy
		// holds: it is the emergency brake, and replaces anything. The
		// tenant's own freeze it replaces, as this copy has it, goes
		// with it, for its unfreeze to put back. A copy behind may hold
		// one the tenant has lifted since, or lack one written
		// meanwhile: every reader replaces the one in force there
		// instead (State.applyLocked).
		replaced = tenantFreeze(current, tool, tenant)
	}
	return s.publish(ctx, s.action(operator, KindFreeze, reason, func(a *Action) { a.Tool, a.Tenant, a.Replaced = tool, tenant, replaced }))
}

// roomFor refuses a tenant operator's action that would add subject to
// the tenant's subjects past Config.MaxTenantSubjects; one already there
// is replaced, which adds nothing.
func (s *Service) roomFor(op identity.Identity, subject string) error {
	if s.cfg.MaxTenantSubjects < 0 {
		return nil
	}
	if n, present := s.cfg.State.tenantSubjects(op.Tenant, subject); !present && n >= s.cfg.MaxTenantSubjects {
		return fmt.Errorf("%w: tenant %s has %d tools' freezes and families' revocations on the control topic, the most it may have; a platform operator can act beyond that", ErrTooManySubjects, op.Tenant, n)
	}
	return nil
}

// maxKeyEpochAhead is how far after now a revoked family's key epoch may
// lie: a key is published CacheFor (a minute by default) before it
// signs, and its executor's clock may have been set back since.
const maxKeyEpochAhead = 24 * time.Hour

// tenantFreeze is the tenant operator's own freeze of tool for tenant
// that current, the freeze of that subject in force, is or replaced; nil
// if none. A record not of that shape (written by hand) counts as none;
// one that is is taken as this build writes it (its subject and version
// made again), so that what is put back is applied.
func tenantFreeze(current Action, tool, tenant string) *Action {
	own := &current
	if current.ByTenant == PlatformTenant {
		own = current.Replaced
	}
	if own == nil || own.Kind != KindFreeze || own.Tool != tool || own.Tenant != tenant || own.ByTenant != tenant {
		return nil
	}
	a := *own
	// The tenant's action itself, not a control service's copy of it:
	// put back, it is a new record, not one that stands for another.
	a.At = a.Made()
	a.V, a.Subject, a.Replaced, a.Restored, a.Reasserts, a.Follows = ActionVersion, ToolSubject(tool, tenant), nil, nil, nil, nil
	return &a
}

// Unfreeze lifts the freeze of tool for tenant ("" for the freeze of every
// tenant; a tenant operator's unfreeze is always for its own tenant). It
// lifts exactly that freeze: a freeze of every tenant and one of a single
// tenant are lifted separately. ErrNotFrozen when that freeze is not in
// force. of, when not zero, is the time (At) of the freeze the operator
// means to lift: ErrFreezeChanged when the one in force is another (a
// freeze replaced by a newer one, for another incident, is not lifted by
// an unfreeze meant for the first). The check is against this instance's
// copy of the control topic, which must be current within
// Config.MaxStaleness (else ErrStale, after waiting up to a second for
// it). A tenant operator does not lift a platform operator's freeze of
// its tenant (ErrForbidden); a platform operator's unfreeze of a freeze
// that replaced the tenant's own puts that one back in force, from the
// unfreeze on (Action.Restored), rather than lift both. Both checks are
// of that copy first, and then of the topic: the unfreeze names the
// freeze it lifts (Action.Lifts), and a freeze written meanwhile through
// another instance, which that copy had not read, overrules it on every
// copy (State.overrulesLocked), with the same refusals. It waits like
// Freeze.
func (s *Service) Unfreeze(ctx context.Context, operator identity.Identity, tool, tenant, reason string, of time.Time) (Action, error) {
	if !s.cfg.State.isReady() {
		return Action{}, ErrNotReady
	}
	tenant, reason, err := s.toolScope(operator, tool, tenant, reason)
	if err != nil {
		return Action{}, err
	}
	defer s.lockSubject(ToolSubject(tool, tenant))()
	if err := s.current(ctx); err != nil {
		return Action{}, err
	}
	current, frozen := s.cfg.State.frozenExactly(tool, tenant)
	if !frozen {
		return Action{}, s.notFrozen(operator, tool, tenant)
	}
	if operator.Tenant != PlatformTenant && current.ByTenant == PlatformTenant {
		return Action{}, platformFreeze(current)
	}
	if !of.IsZero() && !sameAction(current, of) {
		return Action{}, fmt.Errorf("%w: the freeze of %s in force is by %s at %s (%q), not the one at %s: look at it before lifting it",
			ErrFreezeChanged, ToolSubject(tool, tenant), current.By, current.At.UTC().Format(time.RFC3339Nano), current.Reason, of.UTC().Format(time.RFC3339Nano))
	}
	lifts := current.Made()
	unfreeze := s.action(operator, KindUnfreeze, reason, func(a *Action) { a.Tool, a.Tenant, a.Lifts = tool, tenant, &lifts })
	if current.ByTenant != PlatformTenant {
		return s.publish(ctx, unfreeze)
	}
	// A platform freeze that replaced the tenant's own freeze lifts only
	// itself: the tenant's goes back in force (its operator and reason),
	// in the same write as the unfreeze, so that no reader applies the
	// one without the other. Its time is the millisecond after the
	// unfreeze's, when it is in force again: a copy of the first would
	// be one row with it in the history ClickHouse keeps, and sort
	// before the unfreeze there.
	unfreeze.Restored = tenantFreeze(current, tool, tenant)
	if unfreeze.Restored == nil {
		return s.publish(ctx, unfreeze)
	}
	unfreeze.Restored.At = unfreeze.At.Add(time.Millisecond)
	return s.publish(ctx, unfreeze, *unfreeze.Restored)
}

// current returns nil once the State is current within MaxStaleness,
// waiting up to staleWait for it: a check of what is in force (the
// freeze an unfreeze lifts, one a freeze must not replace) must not be
// made on a copy that may lack the latest actions (its fetches stalled,
// say). The error matches ErrStale, or is ctx's.
func (s *Service) current(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, staleWait)
	defer cancel()
	err := s.cfg.State.Current(cctx, s.cfg.MaxStaleness)
	if err != nil && ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// platformFreeze is the refusal of a tenant operator's action on a
// platform operator's freeze.
// notFrozen is the refusal of an unfreeze of tool for tenant when no
// freeze of exactly that is in force. When the tool is frozen for every
// tenant, the tenant's calls are refused all the same: "not frozen" alone
// would contradict them, so the refusal names the freeze that is, and a
// tenant operator, who cannot lift it, is refused as for a platform
// operator's freeze of its tenant, told neither who made it nor why, as
// Snapshot does not tell it: a platform operator's reason may speak of
// other tenants.
func (s *Service) notFrozen(operator identity.Identity, tool, tenant string) error {
	all, frozen := s.cfg.State.frozenExactly(tool, "")
	switch {
	case tenant == "" || !frozen:
		return fmt.Errorf("%w: %s", ErrNotFrozen, ToolSubject(tool, tenant))
	case operator.Tenant != PlatformTenant:
		return fmt.Errorf("%w: %s by a platform operator: only a platform operator lifts that freeze; no freeze of %s alone is in force",
			ErrForbidden, FrozenDetail(all.Subject, all), ToolSubject(tool, tenant))
	default:
		return fmt.Errorf("%w: %s (it is frozen for every tenant, %s by %s (%q), which an unfreeze for every tenant lifts)",
			ErrNotFrozen, ToolSubject(tool, tenant), all.Subject, all.By, all.Reason)
	}
}

func platformFreeze(a Action) error {
	return fmt.Errorf("%w: %s is frozen by platform operator %s (%q): only a platform operator replaces or lifts that freeze",
		ErrForbidden, a.Subject, a.By, a.Reason)
}

// ActivatePolicy makes the policy version labelled label the one every
// intake and executor decides with (each loads it from its policy
// versions directory). hash, when set, pins the version's content (the
// policy set's hash, "sha256:" and 64 lowercase hex digits): an instance
// whose files under the label hash otherwise decides no call with them,
// and denies every call until they match. Platform operators only. It
// waits like Freeze.
func (s *Service) ActivatePolicy(ctx context.Context, operator identity.Identity, label, hash, reason string) (Action, error) {
	if err := s.platformOnly(operator, "activates a policy version"); err != nil {
		return Action{}, err
	}
	defer s.lockSubject(PolicySubject)()
	if err := checkID("policy", label, "/\\@*:"); err != nil {
		return Action{}, err
	}
	if label == "." || label == ".." {
		return Action{}, fmt.Errorf("%w: policy must name a version directory", ErrInvalidRequest)
	}
	if hash != "" && !policyHashRE.MatchString(hash) {
		return Action{}, fmt.Errorf("%w: policy_hash must be \"sha256:\" and 64 lowercase hex digits, the policy set's hash", ErrInvalidRequest)
	}
	reason, err := checkReason(reason)
	if err != nil {
		return Action{}, err
	}
	return s.publish(ctx, s.action(operator, KindActivatePolicy, reason, func(a *Action) { a.Policy, a.PolicyHash = label, hash }))
}

// platformOnly refuses what only a platform operator does (what: "activates
// a policy version"), and everything until the State is ready.
func (s *Service) platformOnly(operator identity.Identity, what string) error {
	if !s.cfg.State.isReady() {
		return ErrNotReady
	}
	platform, err := s.operator(operator)
	if err != nil {
		return err
	}
	if !platform {
		return fmt.Errorf("%w: only a platform operator %s", ErrForbidden, what)
	}
	return nil
}

// WithdrawPolicy ends the policy activation in force (ErrNotActive if
// none, as this instance's copy of the control topic has it, which must
// be current): every intake and executor decides with its --policy-dir
// again. The withdrawal names the activation it ends (Action.Lifts, its
// time): one written meanwhile through another instance overrules it on
// every copy, and it is refused ErrActivationChanged. It is the subject's
// last record on the compacted topic, and its time beats an activation
// left in a partition the subject no longer hashes to. Builds before this
// one ignore it (and keep the activation): upgrade every role first.
// Platform operators only. It waits like Freeze.
func (s *Service) WithdrawPolicy(ctx context.Context, operator identity.Identity, reason string) (Action, error) {
	if err := s.platformOnly(operator, "withdraws a policy activation"); err != nil {
		return Action{}, err
	}
	reason, err := checkReason(reason)
	if err != nil {
		return Action{}, err
	}
	defer s.lockSubject(PolicySubject)()
	if err := s.current(ctx); err != nil {
		return Action{}, err
	}
	active, ok := s.cfg.State.ActivePolicy()
	if !ok {
		return Action{}, fmt.Errorf("%w: every role decides with its --policy-dir", ErrNotActive)
	}
	lifts := active.Made()
	return s.publish(ctx, s.action(operator, KindWithdrawPolicy, reason, func(a *Action) { a.Policy, a.Lifts = active.Policy, &lifts }))
}

// Revoke revokes one credential (jti) or a credential family (family,
// "<tool>:<tenant>:<epoch>"); exactly one of them must be set. A
// revocation is permanent; revoking a jti already revoked returns the
// revocation in force and publishes nothing. A family's revocation covers
// the credentials issued up to it (and RevocationSkew after), and the
// family goes on being minted: revoking it again once that time has
// passed publishes a revocation as of now, which covers the credentials
// issued since (one leaked after the first revocation, say); before, it
// returns the revocation in force. It waits like Freeze.
func (s *Service) Revoke(ctx context.Context, operator identity.Identity, jti, family, reason string) (Action, error) {
	if !s.cfg.State.isReady() {
		return Action{}, ErrNotReady
	}
	platform, err := s.operator(operator)
	if err != nil {
		return Action{}, err
	}
	if reason, err = checkReason(reason); err != nil {
		return Action{}, err
	}
	switch {
	case (jti == "") == (family == ""):
		return Action{}, fmt.Errorf("%w: name exactly one of jti and family", ErrInvalidRequest)
	case jti != "":
		if !platform {
			return Action{}, fmt.Errorf("%w: only a platform operator may revoke a single jti; revoke the family instead", ErrForbidden)
		}
		if err := checkID("jti", jti, ""); err != nil {
			return Action{}, err
		}
		if a, ok := s.cfg.State.Revoked(jti, ""); ok {
			return a, nil
		}
	default:
		_, tenant, epoch, err := parseFamily(family)
		if err != nil {
			return Action{}, err
		}
		if !platform && tenant != operator.Tenant {
			return Action{}, fmt.Errorf("%w: an operator of tenant %s may not revoke a family of tenant %s", ErrForbidden, operator.Tenant, tenant)
		}
		// A key epoch is the Unix second its key started signing by its
		// executor's clock, which may have been set back since (the key
		// signs on): only an epoch no key could have is refused, a typo
		// (milliseconds, say) that would revoke nothing and stay on the
		// topic for good.
		if latest := s.cfg.Now().Add(maxKeyEpochAhead); time.Unix(epoch, 0).After(latest) {
			return Action{}, fmt.Errorf("%w: family %s names a key that starts signing at %s, more than a day from now: key epochs are the Unix second a key started signing, as the events' credential_family has it", ErrInvalidRequest, family, time.Unix(epoch, 0).UTC().Format(time.RFC3339))
		}
		if a, ok := s.cfg.State.Revoked("", family); ok && s.covers(a, s.cfg.Now()) {
			return a, nil
		}
		if !platform {
			if err := s.roomFor(operator, FamilySubject(family)); err != nil {
				return Action{}, err
			}
		}
	}
	return s.publish(ctx, s.action(operator, KindRevoke, reason, func(a *Action) { a.JTI, a.Family = jti, family }))
}

// covers reports whether revocation a covers a credential issued at
// issued, with Config.RevocationSkew (Covers).
func (s *Service) covers(a Action, issued time.Time) bool {
	return Covers(a, issued, s.cfg.RevocationSkew)
}

// Covers reports whether revocation a covers a credential issued at
// issued: every one of a jti's; a family's issued up to it, and skew
// after (the clocks' allowance; none when negative). The tools judge by
// it (introspection), and so must whoever would send a credential
// rather than have it refused.
func Covers(a Action, issued time.Time, skew time.Duration) bool {
	return a.JTI != "" || !issued.After(a.At.Add(max(skew, 0)))
}

// Snapshot returns what operator may see of the control state: everything
// for a platform operator; for a tenant operator, the freezes of every
// tenant and of its own, and the revocations of its own families. Of a
// freeze of every tenant's, a tenant operator sees neither who made it nor
// why, as an agent's refusal says neither (FrozenDetail): a platform
// operator's reason may speak of other tenants.
func (s *Service) Snapshot(ctx context.Context, operator identity.Identity) (Snapshot, error) {
	if !s.cfg.State.isReady() {
		return Snapshot{}, ErrNotReady
	}
	platform, err := s.operator(operator)
	if err != nil {
		return Snapshot{}, err
	}
	// As the other reads: a copy not known current would show a freeze
	// or a revocation made elsewhere as not made (ErrStale).
	if err := s.current(ctx); err != nil {
		return Snapshot{}, err
	}
	snap := s.cfg.State.Snapshot()
	if platform {
		return snap, nil
	}
	snap.Freezes = slices.DeleteFunc(snap.Freezes, func(a Action) bool {
		return a.Tenant != "" && a.Tenant != operator.Tenant
	})
	for i, a := range snap.Freezes {
		if a.Tenant == "" {
			snap.Freezes[i].By, snap.Freezes[i].Reason = "", ""
		}
	}
	if snap.Policy != nil {
		// The version is on every call's events; who and why are the
		// platform's, as for a freeze of every tenant.
		snap.Policy.By, snap.Policy.Reason = "", ""
	}
	snap.Revocations = slices.DeleteFunc(snap.Revocations, func(a Action) bool {
		if a.Family == "" {
			return true
		}
		_, tenant, _, err := parseFamily(a.Family)
		return err != nil || tenant != operator.Tenant
	})
	return snap, nil
}

func (s *Service) action(op identity.Identity, kind, reason string, fill func(*Action)) Action {
	a := Action{V: ActionVersion, Kind: kind, By: op.User, ByTenant: op.Tenant, Reason: reason, At: s.cfg.Now().UTC()}
	fill(&a)
	a.Subject = subjectOf(a)
	return a
}

// publish appends a to the control topic and waits for the local State to
// apply it. One that every State passed over, for a record written
// meanwhile through another instance (State.overrulesLocked), fails as
// the check against a current copy would have; Run puts the action in
// force back on the topic after it.
func (s *Service) publish(ctx context.Context, a Action, then ...Action) (Action, error) {
	first, err := s.put(ctx, a, then...)
	if err != nil {
		return a, err
	}
	if cur, passed := s.cfg.State.passedOver(first.Partition, first.Offset); passed {
		return Action{}, overruledErr(a, cur)
	}
	return a, nil
}

// Run puts back on the topic, until ctx ends, each action in force after
// a record of its subject that every State passed over (a freeze, an
// unfreeze or a withdrawal that raced another written through another
// instance): on the compacted topic a subject keeps its last record
// alone, and a reader starting then would apply the loser. It does so
// for records any writer wrote, this instance's, another's (one that
// stopped between its write and the repair), or a hand-written one; every
// control service may. The copy it writes (Action.Reasserts) stands only
// while the action it copies is still the subject's last: one written
// meanwhile (an unfreeze, an activation) is not undone by it, and is
// itself put back after it. It writes only from a copy of the topic known
// current, and not again while its last write is not applied here. Run it
// beside the Handler.
func (s *Service) Run(ctx context.Context) error {
	for {
		changed := s.cfg.State.changes()
		wait := time.Second
		if repairs := s.cfg.State.toRepair(); len(repairs) > 0 {
			if err := s.current(ctx); err != nil {
				// Written from a copy behind, a repair could copy an
				// action the topic has since ended.
				if ctx.Err() != nil {
					return nil
				}
				repairs = nil
			}
			for _, rp := range repairs {
				made, after := rp.cur.Made(), rp.after
				r := rp.cur
				r.At, r.Reasserts, r.Follows = s.cfg.Now().UTC(), &made, &after
				unlock := s.lockSubject(r.Subject)
				s.cfg.Logger.Warn("control action in force written again after a record of its subject that was overruled", attrKind, r.Kind, attrSubject, r.Subject,
					attrBy, r.By, "made_at", made)
				_, err := s.put(ctx, r)
				unlock()
				switch {
				case ctx.Err() != nil:
					return nil
				case errors.Is(err, ErrNotYetApplied):
					// Not written again until this copy has read it:
					// at the next change.
					wait = time.Hour
				case err != nil:
					s.cfg.Logger.Error("control action in force not written again; retrying", attrSubject, r.Subject, "err", err)
				}
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		case <-time.After(wait):
		}
	}
}

// put appends a, and then those after it, to the control topic, and
// waits for the local State to apply them: ErrNotYetApplied after
// Config.ApplyWait. It returns a's record.
func (s *Service) put(ctx context.Context, a Action, then ...Action) (*kgo.Record, error) {
	recs := make([]*kgo.Record, 0, 1+len(then))
	at := time.Now()
	for _, b := range append([]Action{a}, then...) {
		value, err := json.Marshal(b)
		if err != nil {
			return nil, fmt.Errorf("encode control action: %v", err)
		}
		// Each after the one before it, in the milliseconds Kafka keeps.
		at = s.cfg.State.stamp(b.Subject, at)
		recs = append(recs, &kgo.Record{Topic: s.cfg.Topics.Control, Key: []byte(b.Subject), Value: value, Timestamp: at})
		at = at.Add(time.Millisecond)
	}
	if err := s.cfg.Publisher.Publish(ctx, recs...); err != nil {
		return nil, fmt.Errorf("publish %s of %s: %w", a.Kind, a.Subject, err)
	}
	rec := recs[len(recs)-1]
	s.cfg.Logger.Info("control action published", attrKind, a.Kind, attrSubject, a.Subject,
		attrBy, a.By, attrByTenant, a.ByTenant, "reason", a.Reason, "partition", rec.Partition, "offset", rec.Offset)
	for _, b := range then {
		s.cfg.Logger.Info("control action published with it", attrKind, b.Kind, attrSubject, b.Subject, attrBy, b.By, attrByTenant, b.ByTenant, "reason", b.Reason)
	}
	if !s.cfg.State.waitApplied(ctx, rec.Topic, rec.Partition, rec.Offset, s.cfg.ApplyWait) {
		s.cfg.Logger.Warn("control action not yet applied locally", attrKind, a.Kind, attrSubject, a.Subject, "waited", s.cfg.ApplyWait)
		return recs[0], ErrNotYetApplied
	}
	return recs[0], nil
}

// overruledErr is the refusal of a, passed over for cur, the action in
// force, written first through another instance.
func overruledErr(a, cur Action) error {
	if a.Kind == KindWithdrawPolicy {
		return fmt.Errorf("%w: the activation in force is of %s by %s at %s (%q), made while this withdrawal was on its way: look at it before withdrawing it",
			ErrActivationChanged, cur.Policy, cur.By, cur.At.UTC().Format(time.RFC3339Nano), cur.Reason)
	}
	if a.ByTenant != PlatformTenant && cur.ByTenant == PlatformTenant {
		return platformFreeze(cur)
	}
	return fmt.Errorf("%w: the freeze of %s in force is by %s at %s (%q), frozen again while this %s was on its way: look at it before lifting it",
		ErrFreezeChanged, cur.Subject, cur.By, cur.At.UTC().Format(time.RFC3339Nano), cur.Reason, a.Kind)
}
