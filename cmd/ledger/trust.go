package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/toolcall-ledger/ledger/processors/control"
	"github.com/toolcall-ledger/ledger/processors/credentials"
	"github.com/toolcall-ledger/ledger/processors/identity"
	"github.com/toolcall-ledger/ledger/processors/intake"
	"github.com/toolcall-ledger/ledger/processors/policy"
)

// DevIssuer names the issuer `ledger dev` runs; its key lives in the data
// directory as devIssuerFile.
const (
	DevIssuer     = "ledger-dev"
	devIssuerFile = "issuer.jwk"
)

// identityFlags configure whose assertions the intake trusts.
type identityFlags struct {
	issuer   string
	audience string
	jwksFile string
	jwksURL  string
	// maxLifetime is identity.Config.MaxLifetime.
	maxLifetime time.Duration
	// staff: the callers are approvers and operators (registerStaff).
	staff bool
	// otherAudience is the other role's audience as the deployment
	// configures it (the agents' roles' --staff-audience, the staff's
	// --agents-audience): an assertion naming it too is refused, as one
	// naming the other role's default is.
	otherAudience string
}

func (f *identityFlags) register(fs *pflag.FlagSet) {
	f.registerFor(fs, "audience", identity.DefaultAudience, "the audience assertions must name")
	fs.StringVar(&f.otherAudience, "staff-audience", identity.ApproverAudience, "the audience of the approvers' and operators' assertions (the staff roles' --staff-audience): an assertion that names it besides this role's is refused (aud_mismatch), as one naming its default is, so that a token issued for both never submits calls")
}

// registerStaff registers the flags of a command whose callers are staff
// (approvers, operators): the same, their assertions' audience
// --staff-audience (LEDGER_STAFF_AUDIENCE), identity.ApproverAudience by
// default, so that an agent's assertion is not one of theirs. A flag of
// its own, not the intake's --audience: one LEDGER_AUDIENCE in a
// configuration every role shares would give the staff the agents'
// audience, and an agent's assertion for a user who approves would
// approve.
func (f *identityFlags) registerStaff(fs *pflag.FlagSet) {
	f.staff = true
	f.registerFor(fs, "staff-audience", identity.ApproverAudience, "the audience the approvers' and operators' assertions must name; never the agents' (the intake's --audience)")
	fs.StringVar(&f.otherAudience, "agents-audience", identity.DefaultAudience, "the audience of the agents' assertions (the intake's --audience): a staff assertion that names it besides --staff-audience is refused (aud_mismatch), as one naming its default is, so that a token issued for both never approves, freezes or asks; ledger api also takes the agents' calls and lookups under it")
}

func (f *identityFlags) registerFor(fs *pflag.FlagSet, audienceFlag, audience, audienceUsage string) {
	fs.StringVar(&f.issuer, "issuer", "", "the identity provider whose assertions the intake trusts (its iss)")
	fs.StringVar(&f.audience, audienceFlag, audience, audienceUsage)
	fs.StringVar(&f.jwksFile, "jwks-file", "", "the issuer's public keys (JWKS) in a file, re-read every 5 min, early (at most once a minute) on an unknown kid")
	fs.StringVar(&f.jwksURL, "jwks-url", "", "the issuer's public keys (JWKS) at an https URL, cached and refreshed")
	fs.DurationVar(&f.maxLifetime, "max-assertion-lifetime", identity.DefaultMaxLifetime, fmt.Sprintf("the longest an assertion may be valid: one whose exp is further than this from now (plus %s of clock skew), or from its iat, is refused (assertion_lifetime_too_long); at most %gh", identity.DefaultSkew, identity.MaxMaxLifetime.Hours()))
}

func (f *identityFlags) verifier(ctx context.Context, logger *slog.Logger) (*identity.Verifier, error) {
	if f.issuer == "" || (f.jwksFile == "") == (f.jwksURL == "") {
		return nil, errors.New("the intake needs --issuer and exactly one of --jwks-file or --jwks-url")
	}
	// 0 would mean identity's default, not "unbounded" as one might read
	// it: refuse it rather than surprise.
	if f.maxLifetime <= 0 || f.maxLifetime > identity.MaxMaxLifetime {
		return nil, fmt.Errorf("--max-assertion-lifetime must be more than 0 and at most %s", identity.MaxMaxLifetime)
	}
	// Empty would mean identity's default, the agents' audience.
	switch {
	case f.staff && (f.audience == "" || f.audience == identity.DefaultAudience || f.audience == f.otherAudience):
		return nil, fmt.Errorf("--staff-audience %q: the approvers' and operators' assertions must name an audience of their own, not empty and not the agents' (%q, --agents-audience %q), or an agent's assertion for a user who approves would approve", f.audience, identity.DefaultAudience, f.otherAudience)
	case f.audience == "":
		return nil, errors.New("--audience must not be empty")
	}
	return identity.New(ctx, identity.Config{
		Issuer: f.issuer, Audience: f.audience, OtherAudiences: f.otherAudiences(), JWKSFile: f.jwksFile, JWKSURL: f.jwksURL, MaxLifetime: f.maxLifetime, Logger: logger,
	})
}

// otherAudiences are identity.Config.OtherAudiences: the other role's
// default audience, and its audience as configured.
func (f *identityFlags) otherAudiences() []string {
	other := identity.ApproverAudience
	if f.staff {
		other = identity.DefaultAudience
	}
	return slices.Compact([]string{other, cmp.Or(f.otherAudience, other)})
}

// devIdentity loads (creating on first use) the dev issuer's key in the
// data directory, and verifiers that trust exactly it: one for agents'
// assertions, one for approvers' and operators'.
func devIdentity(ctx context.Context, dataDir string, logger *slog.Logger) (*identity.Issuer, *identity.Verifier, *identity.Verifier, error) {
	iss, err := identity.LoadOrCreateIssuer(filepath.Join(dataDir, devIssuerFile), DevIssuer)
	if err != nil {
		return nil, nil, nil, err
	}
	agents, err := identity.New(ctx, identity.Config{Issuer: DevIssuer, OtherAudiences: []string{identity.ApproverAudience}, Keys: iss.Keys(), Logger: logger})
	if err != nil {
		return nil, nil, nil, err
	}
	staff, err := identity.New(ctx, identity.Config{Issuer: DevIssuer, Audience: identity.ApproverAudience, OtherAudiences: []string{identity.DefaultAudience}, Keys: iss.Keys(), Logger: logger})
	if err != nil {
		return nil, nil, nil, err
	}
	return iss, agents, staff, nil
}

// policyFlags choose the policy set.
type policyFlags struct {
	dir        string
	label      string
	versions   string
	timeout    time.Duration
	retryAfter time.Duration
	roles      bool
}

// register registers the policy flags; rolesByDefault is --policy-roles'
// default, on only where every process is of this build (ledger dev).
func (f *policyFlags) register(fs *pflag.FlagSet, rolesByDefault bool) {
	fs.StringVar(&f.dir, "policy-dir", "", "directory of *.cedar policies, reloaded when it changes (default: the built-in demo policies)")
	fs.StringVar(&f.label, "policy-label", "local", "label of --policy-dir's policy set's version (the version is <label>@<content hash>); the built-in demo policies are always labelled demo")
	f.registerTimeout(fs)
	fs.BoolVar(&f.roles, "policy-roles", rolesByDefault, "give the policies the caller's roles (the assertion's roles claim) as principal.roles, and record them on the call's events, with which executors decide an approved call again. Those events are of encoding version 2, which builds before it refuse: set it on every intake, executor and reconciler, once every process of the deployment (approval services, projectors and the APIs included) is of a build that reads it: on the executors and reconcilers first, the intakes last (off: the intakes first). Without it a policy that reads principal.roles denies (policy_error)")
	fs.StringVar(&f.versions, "policy-versions-dir", "", "directory of policy versions, <label>/*.cedar: the version an operator activates on the control topic (ledger control activate-policy) is loaded from it and wins over --policy-dir for as long as it is in force; while it does not load, or its files are not the content the activation pins (or this directory is not set), every call is denied and /readyz fails")
}

// registerTimeout registers --policy-timeout alone, for the processes
// `ledger bench` starts, whose policies are the demo's.
func (f *policyFlags) registerTimeout(fs *pflag.FlagSet) {
	fs.DurationVar(&f.timeout, "policy-timeout", policy.DefaultTimeout, "bound on one policy decision (wall-clock; 0: the default). Not decided in time fails closed: the intake refuses the call for now (policy_timeout, its key left free, retry after --policy-retry-after), the executor gives an approved call's claim back and decides it again later. Raise it for large policy sets or hosts that stall")
}

// registerRefusals registers the flags of a command that refuses calls
// (it admits them, as the intake): the executor's policies only re-check
// calls already admitted.
func (f *policyFlags) registerRefusals(fs *pflag.FlagSet) {
	fs.DurationVar(&f.retryAfter, "policy-retry-after", intake.DefaultPolicyRetryAfter, "the wait (retry_after_ms) that the refusal of a call the policies could not decide names: a policy_timeout, or no policy set active (0: the default)")
}

// followActivations keeps engine on the version activated on the control
// topic, loaded from --policy-versions-dir; it returns when ctx ends.
// Without that directory an activation cannot be loaded, and fails closed
// as any version that does not load: an operator's activation is never
// silently ignored.
func (f *policyFlags) followActivations(ctx context.Context, engine *policy.Engine, controls *control.State) error {
	return engine.FollowActivations(ctx, f.versions, controls.PolicyActivation, 500*time.Millisecond)
}

// activate brings engine to the version activated on the control topic
// now: a role calls it, once its copy of the topic has caught up, before
// its loops decide a call, which would otherwise be decided with the set
// the activation replaced until followActivations' first tick.
func (f *policyFlags) activate(engine *policy.Engine, controls *control.State) {
	engine.Sync(f.versions, controls.PolicyActivation)
}

// syncing is intake.Config.SyncPolicies for engine: activate, as the
// control copy has it when a step decides its calls, not at the next of
// followActivations' ticks (half a second away).
func (f *policyFlags) syncing(engine *policy.Engine, controls *control.State) func() {
	return func() { f.activate(engine, controls) }
}

// syncedDecider decides with engine brought, first, to the version the
// control copy activates (sync): the executors' re-checks of approved
// calls, each decided with the version in force, as the intake's steps
// are. They are few, so it syncs at each decision.
type syncedDecider struct {
	engine *policy.Engine
	sync   func()
}

// Decide implements executor.Decider.
func (d syncedDecider) Decide(ctx context.Context, r policy.Request) policy.Decision {
	d.sync()
	return d.engine.Decide(ctx, r)
}

// engine returns the policy engine and, when a directory is watched, the
// watcher to run until ctx ends.
func (f *policyFlags) engine(logger *slog.Logger) (*policy.Engine, func(ctx context.Context) error, error) {
	var (
		set *policy.Set
		err error
	)
	if f.dir == "" {
		set, err = policy.Demo()
	} else {
		set, err = policy.LoadDir(f.dir, f.label)
	}
	if err != nil {
		return nil, nil, err
	}
	if f.retryAfter < 0 {
		return nil, nil, fmt.Errorf("--policy-retry-after %v: must not be negative", f.retryAfter)
	}
	if f.timeout < 0 {
		return nil, nil, fmt.Errorf("--policy-timeout %v: must not be negative", f.timeout)
	}
	e, err := policy.NewEngine(policy.Config{Set: set, Logger: logger, Timeout: f.timeout, Roles: f.roles})
	if err != nil {
		return nil, nil, err
	}
	watch := func(ctx context.Context) error { <-ctx.Done(); return nil }
	if f.dir != "" {
		watch = func(ctx context.Context) error { return e.WatchDir(ctx, f.dir, f.label, 2*time.Second) }
	}
	return e, watch, nil
}

// credentialFlags configure the executor's credential broker and the
// keystore of the backends' long-lived secrets.
type credentialFlags struct {
	keyDir     string
	ttl        time.Duration
	rotate     time.Duration
	secretsDir string
}

// keystore returns the backends' secrets keystore: --secrets-dir, or
// <data-dir>/secrets.
func (f *credentialFlags) keystore(dataDir string) *credentials.Keystore {
	dir := f.secretsDir
	if dir == "" && dataDir != "" {
		dir = filepath.Join(dataDir, "secrets")
	}
	return credentials.NewKeystore(dir)
}

func (f *credentialFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.keyDir, "credential-key-dir", "", "where the credential broker keeps its signing keys (default: <data-dir>/credentials)")
	fs.DurationVar(&f.ttl, "credential-ttl", 5*time.Minute, "the longest a per-call credential lives (it never outlives the call's deadline); at least 1s")
	fs.DurationVar(&f.rotate, "credential-rotate", 24*time.Hour, "how often the credential signing key rotates; at least --credential-ttl + 2m30s, since a new key is published a minute before it signs and a retired one stays published until its last credential has expired (plus 30s of clock skew and a minute of caching)")
	fs.StringVar(&f.secretsDir, "secrets-dir", "", "keystore of the backends' long-lived secrets, one 0600 file per registry backend.secret_ref (default: <data-dir>/secrets)")
}

func (f *credentialFlags) broker(dataDir string, logger *slog.Logger) (*credentials.Broker, error) {
	dir := f.keyDir
	if dir == "" && dataDir != "" {
		dir = filepath.Join(dataDir, "credentials")
	}
	b, err := credentials.New(credentials.Config{KeyDir: dir, TTL: f.ttl, RotateEvery: f.rotate, Logger: logger})
	if errors.Is(err, credentials.ErrInvalidConfig) {
		return nil, fmt.Errorf("--credential-ttl %v, --credential-rotate %v: %w", f.ttl, f.rotate, err)
	}
	return b, err
}

func newTokenCmd(g *globals) *cobra.Command {
	var (
		dataDir          string
		keyFile, keyName string
		id               identity.Identity
		roles            string
		approver         bool
		operator         bool
		ttl              time.Duration
	)
	cmd := &cobra.Command{
		Use:   "token",
		Short: "Mint an identity assertion from the dev issuer of `ledger dev`, or from a key of your own (--issuer-key), for trying things out, never for production",
		Example: `  ledger token --tenant t_demo --user u_demo
  ledger token --tenant t_demo --user u_boss --approver
  ledger token --tenant '*' --user u_ops --operator          # a platform operator
  ledger token --issuer-key ./agents.jwk --issuer https://idp.test --tenant t_acme --user u_1`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var iss *identity.Issuer
			switch {
			case keyFile == "" && keyName != "":
				return errors.New("token: --issuer names the issuer of --issuer-key")
			case keyFile != "" && keyName == "":
				return errors.New("token: --issuer-key needs --issuer, the issuer name the verifiers trust it under (their --issuer)")
			case keyFile != "":
				var (
					jwks    string
					created bool
					err     error
				)
				if iss, jwks, created, err = issuerKey(keyFile, keyName); err != nil {
					return err
				}
				if created {
					fmt.Fprintf(cmd.ErrOrStderr(), "created %s, its public keys in %s: start the intake, ledger api, approvals serve and the reconciler with --issuer %s --jwks-file %s (or add those keys to the key set they read)\n",
						keyFile, jwks, keyName, jwks)
				}
			default:
				var err error
				if iss, err = devIssuer(dataDir); err != nil {
					return err
				}
			}
			if approver && operator {
				return errors.New("token: --approver or --operator, not both (--roles adds roles)")
			}
			if roles != "" {
				id.Roles = strings.Split(roles, ",")
			}
			audience := identity.DefaultAudience
			if operator {
				// Operators' assertions are for the staff's APIs (the
				// approval queue's audience), as approvers' are.
				id.Roles = append(id.Roles, "operator")
				audience = identity.ApproverAudience
				if !cmd.Flags().Changed("agent") {
					id.Agent = approverAgent
				}
			}
			if approver {
				// Approvers' assertions are for the approval queue
				// only, and the queue takes no other.
				id.Roles = append(id.Roles, "approver")
				audience = identity.ApproverAudience
				if !cmd.Flags().Changed("agent") {
					// Not the agent ledger submit's calls are made
					// through: the queue refuses an approver acting
					// through the agent that requested the call
					// (self_approval), as ledger approvals' agent.
					id.Agent = approverAgent
				}
			}
			if ttl > identity.DefaultMaxLifetime {
				// Not refused: an intake may be run with a longer
				// --max-assertion-lifetime. ledger dev's is the default.
				fmt.Fprintf(cmd.ErrOrStderr(), "warning: --ttl %s is longer than the %s verifiers accept by default (--max-assertion-lifetime); ledger dev refuses this assertion\n", ttl, identity.DefaultMaxLifetime)
			}
			tok, err := iss.Mint(id, audience, ttl)
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), tok)
			return nil
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&dataDir, "data-dir", devDataDir, "the data directory of 'ledger dev', where the dev issuer's key is")
	fs.StringVar(&keyFile, "issuer-key", "", "sign with the private key (a JWK) in this file instead of the dev issuer's; if missing, it is created, with its public keys beside it (<file>.jwks.json) for the verifiers' --jwks-file")
	fs.StringVar(&keyName, "issuer", "", "with --issuer-key: the issuer name (iss) the verifiers trust that key under")
	// A deployment's shell holds LEDGER_ISSUER for the roles, whose
	// identity provider is not this key.
	ignoreEnv(fs, "issuer-key", "issuer")
	fs.BoolVar(&operator, "operator", false, "mint an operator's assertion (the operator role, for the staff's audience: the kill switch, resolutions, compensations, the query API); --tenant '*' for a platform operator")
	// dev takes its directory from its command line alone: so does
	// whatever finds dev's issuer in it.
	ignoreEnv(fs, "data-dir")
	fs.StringVar(&id.Tenant, "tenant", "t_demo", "tenant claim")
	fs.StringVar(&id.User, "user", "u_demo", "subject (the user)")
	fs.StringVar(&id.Agent, "agent", "agent_cli", "actor (the agent); with --approver, "+approverAgent+" unless set (an approver may not decide a call requested through its own agent)")
	fs.StringVar(&id.Purpose, "purpose", "", "purpose claim")
	fs.StringVar(&roles, "roles", "", "roles, comma separated")
	fs.BoolVar(&approver, "approver", false, "mint an approver's assertion (the approver role, for the approval queue's audience)")
	fs.DurationVar(&ttl, "ttl", 10*time.Minute, "how long the assertion is valid (verifiers refuse more than their --max-assertion-lifetime, 1h by default)")
	return cmd
}

// issuerKey loads the issuer name signing with the private key (a JWK) in
// the file path, creating the key when the file is missing, with its
// public key set beside it (jwks, <path>.jwks.json), for the verifiers
// (--issuer, --jwks-file). The key set is written again only when it is
// missing: an operator may have added other keys to it.
func issuerKey(path, name string) (iss *identity.Issuer, jwks string, created bool, err error) {
	jwks = path + ".jwks.json"
	_, statErr := os.Stat(path)
	_, jwksErr := os.Stat(jwks)
	created = errors.Is(statErr, fs.ErrNotExist)
	if created && jwksErr == nil {
		// A key set beside no key (copied to a verifier's host, say):
		// a new key written over it would have its verifiers refuse
		// every assertion of the key it held.
		return nil, "", false, fmt.Errorf("no key at %s, but a key set at %s: refusing to create a key whose public keys would replace it (move the key set away, or give the key file that signs for it)", path, jwks)
	}
	if iss, err = identity.LoadOrCreateIssuer(path, name); err != nil {
		return nil, "", false, err
	}
	if errors.Is(jwksErr, fs.ErrNotExist) {
		// Public keys only: readable by the verifiers' users. Written
		// whole or not at all: a verifier may be reading it.
		tmp := jwks + ".tmp"
		if err := os.WriteFile(tmp, iss.Keys().JWKS(), 0o644); err != nil {
			return nil, "", false, err
		}
		if err := os.Rename(tmp, jwks); err != nil {
			return nil, "", false, err
		}
	}
	return iss, jwks, created, nil
}

// devIssuer loads the dev issuer of `ledger dev` from its data directory;
// it never creates one.
func devIssuer(dataDir string) (*identity.Issuer, error) {
	path := filepath.Join(dataDir, devIssuerFile)
	if _, err := os.Stat(path); err != nil {
		return nil, fmt.Errorf("no dev issuer key at %s: run `ledger dev --data-dir %s` once first", path, dataDir)
	}
	return identity.LoadOrCreateIssuer(path, DevIssuer)
}

// devAssertion mints an assertion for a submit in dev with the dev
// issuer's key in dataDir, and says why it cannot when the key is not
// there or cannot be read.
func devAssertion(dataDir, tenant, user string) (string, error) {
	iss, err := devIssuer(dataDir)
	if err != nil {
		return "", err
	}
	return iss.Mint(identity.Identity{Tenant: tenant, User: user, Agent: "agent_cli"}, identity.DefaultAudience, 10*time.Minute)
}
