package ledger

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/oauth"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/toolcall-ledger/ledger/ledger/tlsfiles"
)

// The SASL mechanisms Security accepts (SASL.Mechanism, in any case).
const (
	MechanismPlain       = "PLAIN"
	MechanismScramSHA256 = "SCRAM-SHA-256"
	MechanismScramSHA512 = "SCRAM-SHA-512"
	MechanismOAuthBearer = "OAUTHBEARER"
)

// validMechanisms lists the mechanisms for error messages.
const validMechanisms = MechanismPlain + ", " + MechanismScramSHA256 + ", " + MechanismScramSHA512 + ", " + MechanismOAuthBearer

// Security is how the ledger's Kafka clients encrypt and authenticate. The
// zero value is plaintext without authentication (ledger dev, tests).
//
// Its String, GoString and LogValue never show the password; the password
// and the token never appear in an error either.
type Security struct {
	TLS  TLS
	SASL SASL
}

// TLS configures the connection's encryption.
type TLS struct {
	// Enabled dials brokers over TLS. Setting any other field of TLS
	// enables it too: a CA or a client certificate means nothing on a
	// plaintext connection.
	Enabled bool
	// CAFile is a PEM file of the CAs that sign the brokers'
	// certificates. Default: the system's roots. It is read at start-up,
	// and again by a new connection when its content has changed (looked
	// at at most once a second), so that a CA rotated on disk is trusted,
	// and the old one no longer, without a restart.
	CAFile string
	// CertFile and KeyFile are the client certificate and its key (PEM),
	// for brokers that require mutual TLS. Both or neither. They are read
	// at start-up, and again as CAFile is, so that a renewed certificate
	// (cert-manager, a Secret volume updated in place) is presented from
	// the next connection; a pair that does not load (caught between the
	// writes of its two files) leaves the last good one in use, with a
	// warning in the client's log.
	CertFile string
	KeyFile  string
	// ServerName is the name checked against every broker's certificate.
	// Default: the host of the address dialled, which suits certificates
	// issued per broker.
	ServerName string
	// InsecureSkipVerify accepts any broker certificate: the connection is
	// encrypted but not authenticated, so anyone on the path can read it.
	// For debugging only.
	InsecureSkipVerify bool
}

// Enabled reports whether s asks for TLS or SASL.
func (s Security) Enabled() bool { return s.TLS.on() || s.SASL.Mechanism != "" }

// on reports whether TLS is wanted, explicitly or through another field.
func (t TLS) on() bool {
	return t.Enabled || t.CAFile != "" || t.CertFile != "" || t.KeyFile != "" || t.ServerName != "" || t.InsecureSkipVerify
}

// SASL configures the client's authentication. PLAIN sends the password
// as it is, and OAUTHBEARER the token: without TLS, the clients refuse to
// send either to a broker that is not on loopback unless AllowPlaintext
// is set. SCRAM sends neither, only a proof of the password.
type SASL struct {
	// Mechanism is "" (no SASL), PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or
	// OAUTHBEARER, in any case.
	Mechanism string
	// User and Password authenticate PLAIN and SCRAM; both required there,
	// and refused with OAUTHBEARER.
	User     string
	Password string
	// TokenFile, for OAUTHBEARER (required there, refused otherwise), is a
	// file whose content, trimmed of surrounding white space, is the
	// bearer token. It is read again for every authentication (each new
	// connection, each re-authentication), so a sidecar that rewrites it
	// rotates the token without a restart. It is not read before the
	// first connection: the sidecar may not have written it yet.
	TokenFile string
	// AllowPlaintext lets PLAIN and OAUTHBEARER send the password or the
	// token without TLS to brokers other than loopback ones: for a network
	// trusted end to end. Without it a seed broker elsewhere fails the
	// client's configuration, and a connection to any other broker (one
	// the cluster's metadata names) is refused before anything is sent.
	AllowPlaintext bool
}

// SecurityError is a Security that cannot be applied. It names the field
// and never quotes a password or a token.
type SecurityError struct {
	// Field is the offending field, as "SASL.Mechanism" or "TLS.CAFile".
	Field string
	// Reason is for humans.
	Reason string
	// Err is the underlying error (reading a file, parsing a key), if any.
	Err error
}

// Error returns the field, the reason and the underlying error.
func (e *SecurityError) Error() string {
	s := "kafka security: " + e.Field + ": " + e.Reason
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Unwrap returns the underlying error, so that errors.Is(err,
// fs.ErrNotExist) works for a missing file.
func (e *SecurityError) Unwrap() error { return e.Err }

func secErr(field, reason string, err error) error {
	return &SecurityError{Field: field, Reason: reason, Err: err}
}

// Opts returns the franz-go options that apply s: a TLS dialer and a SASL
// mechanism, either or both, or none for the zero value. It reads the CA
// and client certificate files now, and fails with a *SecurityError on a
// setting it cannot apply; the client's new connections read them again
// when they change (TLS.CAFile). The options are one client's: the TLS
// dialer learns the client's logger and dial timeout (kgo.DialTimeout)
// from it.
func (s Security) Opts() ([]kgo.Opt, error) {
	var opts []kgo.Opt
	if s.TLS.on() {
		d, err := s.TLS.dialer()
		if err != nil {
			return nil, err
		}
		opts = append(opts, kgo.Dialer(d.dial), kgo.WithHooks(d))
	}
	mech, err := s.SASL.mechanism()
	if err != nil {
		return nil, err
	}
	if mech != nil {
		opts = append(opts, kgo.SASL(mech))
		if s.secretInClear() {
			opts = append(opts, kgo.Dialer(s.SASL.loopbackDial))
		}
	}
	return opts, nil
}

// secretInClear reports whether s would send a password or a token
// without TLS, and only loopback brokers may then be dialled.
func (s Security) secretInClear() bool {
	if s.TLS.on() || s.SASL.AllowPlaintext {
		return false
	}
	switch strings.ToUpper(strings.TrimSpace(s.SASL.Mechanism)) {
	case MechanismPlain, MechanismOAuthBearer:
		return true
	}
	return false
}

// checkBrokers fails with a *SecurityError when s would send a password
// or a token in clear to one of brokers: caught at start-up rather than
// at the first dial, which the client retries.
func (s Security) checkBrokers(brokers []string) error {
	if !s.secretInClear() {
		return nil
	}
	for _, b := range brokers {
		if !loopbackAddr(b) {
			return s.SASL.clearErr(b)
		}
	}
	return nil
}

// defaultDialTimeout bounds a dial as franz-go's own dialer does by
// default.
const defaultDialTimeout = 10 * time.Second

// loopbackDial dials addr only if it is on loopback: the guard for
// brokers learnt from the cluster's metadata, which may advertise other
// addresses than the seeds. "localhost" is resolved by the system, which
// may say otherwise, so the peer is checked too, before anything is sent.
func (a SASL) loopbackDial(ctx context.Context, network, addr string) (net.Conn, error) {
	if !loopbackAddr(addr) {
		return nil, a.clearErr(addr)
	}
	conn, err := (&net.Dialer{Timeout: defaultDialTimeout}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	remote := conn.RemoteAddr()
	if peer, ok := remote.(*net.TCPAddr); !ok || !peer.IP.IsLoopback() {
		_ = conn.Close()
		return nil, a.clearErr(fmt.Sprintf("%s (%s)", addr, remote))
	}
	return conn, nil
}

func (a SASL) clearErr(addr string) error {
	mech := strings.ToUpper(strings.TrimSpace(a.Mechanism))
	what := "the password"
	if mech == MechanismOAuthBearer {
		what = "the token"
	}
	return secErr("SASL.Mechanism", fmt.Sprintf("%s sends %s as it is, and TLS is off: refused for broker %s, which is not on loopback; enable TLS, or set SASL.AllowPlaintext (--kafka-sasl-allow-plaintext) for a network trusted end to end", mech, what, addr), nil)
}

// loopbackAddr reports whether addr (host:port, or a host) names this
// machine: localhost or a loopback IP. Other names are not resolved: what
// they resolve to can change.
func loopbackAddr(addr string) bool {
	host := addr
	if h, _, err := net.SplitHostPort(addr); err == nil {
		host = h
	} else if strings.HasPrefix(host, "[") && strings.HasSuffix(host, "]") {
		host = host[1 : len(host)-1] // "[::1]", without a port
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// tlsReloadEvery is how often, at most, a dial looks at the CA and client
// certificate files again.
const tlsReloadEvery = time.Second

// dialer makes the TLS dialer of t. It reads the CA and client
// certificate files now, so that a wrong setting fails at start-up.
func (t TLS) dialer() (*tlsDialer, error) {
	d := &tlsDialer{t: t, timeout: defaultDialTimeout}
	// A dial looks at the files at most every tlsReloadEvery: a client
	// may dial many brokers at once, and each look reads them whole.
	reload := tlsfiles.Config{Every: tlsReloadEvery, Logger: d}
	if t.CAFile != "" {
		cas, err := tlsfiles.LoadPool(tlsfiles.File{Path: t.CAFile, Name: "TLS.CAFile"}, reload)
		if err != nil {
			return nil, fileErr(err)
		}
		d.cas = cas
	}
	switch {
	case t.CertFile != "" && t.KeyFile == "":
		return nil, secErr("TLS.KeyFile", "a client certificate needs its key file", nil)
	case t.CertFile == "" && t.KeyFile != "":
		return nil, secErr("TLS.CertFile", "a client key needs its certificate file", nil)
	case t.CertFile != "":
		pair, err := tlsfiles.LoadPair(tlsfiles.File{Path: t.CertFile, Name: "TLS.CertFile"}, tlsfiles.File{Path: t.KeyFile, Name: "TLS.KeyFile"}, reload)
		if err != nil {
			return nil, fileErr(err)
		}
		d.pair = pair
	}
	return d, nil
}

// fileErr is an error of tlsfiles as a *SecurityError on the field that
// names the file (tlsfiles.File.Name).
func fileErr(err error) error {
	fe, ok := errors.AsType[*tlsfiles.Error](err)
	if !ok {
		return err
	}
	reason := fe.Reason
	if reason == "" {
		reason = "cannot read the file"
	}
	return secErr(fe.Name, reason, fe.Err)
}

// tlsDialer dials brokers over TLS with a tls.Config made for each
// connection, as franz-go's DialTLSConfig would (the server name defaults
// to the host dialled), but with the client certificate and the CAs of
// the moment: their files are read again when they change, so that a
// certificate renewed or a CA rotated on disk (cert-manager, a Secret
// volume) is used from the next connection, without a restart. The
// broker is checked by crypto/tls itself, against the CAs of the moment.
//
// It is also a kgo.HookNewClient, to learn the client's logger and dial
// timeout, and the tlsfiles.Logger of its files. It is safe for
// concurrent use.
type tlsDialer struct {
	t    TLS
	cas  *tlsfiles.Pool // nil: the system's roots
	pair *tlsfiles.Pair // nil: no client certificate

	mu      sync.Mutex
	logger  kgo.Logger // nil until the client is made
	timeout time.Duration
}

// OnNewClient implements kgo.HookNewClient.
func (d *tlsDialer) OnNewClient(cl *kgo.Client) {
	logger, _ := cl.OptValue(kgo.WithLogger).(kgo.Logger)
	timeout, _ := cl.OptValue(kgo.DialTimeout).(time.Duration)
	d.mu.Lock()
	defer d.mu.Unlock()
	d.logger = logger
	if timeout > 0 {
		d.timeout = timeout
	}
}

// Log implements tlsfiles.Logger: the reloads of the client's files go
// to the client's logger, once the client is made.
func (d *tlsDialer) Log(_ context.Context, level slog.Level, msg string, args ...any) {
	d.mu.Lock()
	logger := d.logger
	d.mu.Unlock()
	// tlsfiles logs a reload at Info, a failed one at Warn.
	l := kgo.LogLevelInfo
	if level >= slog.LevelWarn {
		l = kgo.LogLevelWarn
	}
	if logger != nil && logger.Level() >= l {
		logger.Log(l, "kafka "+msg, args...)
	}
}

// dial is the client's kgo.Dialer.
func (d *tlsDialer) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	name := d.t.ServerName
	if name == "" {
		host, _, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, fmt.Errorf("unable to split host:port for dialing: %w", err)
		}
		name = host
	}
	cfg := &tls.Config{
		MinVersion:         tls.VersionTLS12,
		ServerName:         name,
		InsecureSkipVerify: d.t.InsecureSkipVerify, //nolint:gosec // documented as for debugging only
	}
	if d.cas != nil {
		cfg.RootCAs = d.cas.CertPool()
	}
	if d.pair != nil {
		cfg.GetClientCertificate = d.pair.GetClientCertificate
	}
	d.mu.Lock()
	timeout := d.timeout
	d.mu.Unlock()
	td := &tls.Dialer{NetDialer: &net.Dialer{Timeout: timeout}, Config: cfg}
	return td.DialContext(ctx, network, addr)
}

// mechanism returns the SASL mechanism, or nil when SASL is off.
func (a SASL) mechanism() (sasl.Mechanism, error) {
	name := strings.ToUpper(strings.TrimSpace(a.Mechanism))
	switch name {
	case "":
		if a.User != "" || a.Password != "" || a.TokenFile != "" {
			// Credentials without a mechanism would silently connect
			// unauthenticated.
			return nil, secErr("SASL.Mechanism", "credentials are set but no mechanism; valid: "+validMechanisms, nil)
		}
		return nil, nil
	case MechanismPlain, MechanismScramSHA256, MechanismScramSHA512:
		switch {
		case a.User == "":
			return nil, secErr("SASL.User", "required by "+name, nil)
		case a.Password == "":
			return nil, secErr("SASL.Password", "required by "+name, nil)
		case a.TokenFile != "":
			return nil, secErr("SASL.TokenFile", "only OAUTHBEARER uses a token file, not "+name, nil)
		}
		switch name {
		case MechanismPlain:
			return plain.Auth{User: a.User, Pass: a.Password}.AsMechanism(), nil
		case MechanismScramSHA256:
			return scram.Auth{User: a.User, Pass: a.Password}.AsSha256Mechanism(), nil
		default:
			return scram.Auth{User: a.User, Pass: a.Password}.AsSha512Mechanism(), nil
		}
	case MechanismOAuthBearer:
		switch {
		case a.TokenFile == "":
			return nil, secErr("SASL.TokenFile", "required by "+name, nil)
		case a.Password != "":
			return nil, secErr("SASL.Password", name+" authenticates with the token file alone; unset the password", nil)
		case a.User != "":
			return nil, secErr("SASL.User", name+" authenticates with the token file alone; unset the user", nil)
		}
		path := a.TokenFile
		return oauth.Oauth(func(context.Context) (oauth.Auth, error) {
			return readToken(path)
		}), nil
	default:
		return nil, secErr("SASL.Mechanism", fmt.Sprintf("unknown mechanism %q; valid: %s", a.Mechanism, validMechanisms), nil)
	}
}

// readToken reads the bearer token from path. Its errors name the file,
// never its content.
func readToken(path string) (oauth.Auth, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return oauth.Auth{}, secErr("SASL.TokenFile", "cannot read the token file", err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return oauth.Auth{}, secErr("SASL.TokenFile", fmt.Sprintf("token file %s is empty", path), nil)
	}
	return oauth.Auth{Token: tok}, nil
}

// String describes s for logs: TLS on or off with its files, the mechanism
// and the user; the password only as "[redacted]".
func (s Security) String() string {
	var b strings.Builder
	if s.TLS.on() {
		b.WriteString("tls=on")
		for _, kv := range [][2]string{{"ca", s.TLS.CAFile}, {"cert", s.TLS.CertFile}, {"server_name", s.TLS.ServerName}} {
			if kv[1] != "" {
				fmt.Fprintf(&b, " %s=%s", kv[0], kv[1])
			}
		}
		if s.TLS.InsecureSkipVerify {
			b.WriteString(" insecure_skip_verify=true")
		}
	} else {
		b.WriteString("tls=off")
	}
	return b.String() + " " + s.SASL.String()
}

// GoString is String, so that %#v does not print the password either.
func (s Security) GoString() string { return "ledger.Security{" + s.String() + "}" }

// LogValue is s as slog attributes, without the password.
func (s Security) LogValue() slog.Value {
	attrs := []slog.Attr{slog.Bool("tls", s.TLS.on())}
	if s.TLS.on() {
		attrs = append(attrs,
			slog.String("tls_ca", s.TLS.CAFile),
			slog.String("tls_cert", s.TLS.CertFile),
			slog.String("tls_server_name", s.TLS.ServerName),
			slog.Bool("tls_insecure_skip_verify", s.TLS.InsecureSkipVerify),
		)
	}
	return slog.GroupValue(append(attrs, s.SASL.LogValue().Group()...)...)
}

// String describes a for logs: the mechanism, the user and the token file;
// the password only as "[redacted]". SASL has its own, and not only
// Security, so that printing a SASL alone does not leak the password.
func (a SASL) String() string {
	if a == (SASL{}) {
		return "sasl=off"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "sasl=%s", strings.ToUpper(strings.TrimSpace(a.Mechanism)))
	if a.User != "" {
		fmt.Fprintf(&b, " user=%s", a.User)
	}
	if a.Password != "" {
		b.WriteString(" password=" + Redacted)
	}
	if a.TokenFile != "" {
		fmt.Fprintf(&b, " token_file=%s", a.TokenFile)
	}
	if a.AllowPlaintext {
		b.WriteString(" allow_plaintext=true")
	}
	return b.String()
}

// GoString is String, so that %#v does not print the password either.
func (a SASL) GoString() string { return "ledger.SASL{" + a.String() + "}" }

// MarshalJSON writes a with the password redacted: slog's JSON handler
// marshals a struct that holds a SASL (a ClientConfig logged whole)
// without asking for its LogValue.
func (a SASL) MarshalJSON() ([]byte, error) {
	if a.Password != "" {
		a.Password = Redacted
	}
	type plainSASL SASL // without this method
	return json.Marshal(plainSASL(a))
}

// LogValue is a as slog attributes, without the password.
func (a SASL) LogValue() slog.Value {
	attrs := []slog.Attr{slog.String("sasl_mechanism", strings.ToUpper(strings.TrimSpace(a.Mechanism)))}
	if a.User != "" {
		attrs = append(attrs, slog.String("sasl_user", a.User))
	}
	if a.Password != "" {
		attrs = append(attrs, slog.String("sasl_password", Redacted))
	}
	if a.TokenFile != "" {
		attrs = append(attrs, slog.String("sasl_token_file", a.TokenFile))
	}
	if a.AllowPlaintext {
		attrs = append(attrs, slog.Bool("sasl_allow_plaintext", true))
	}
	return slog.GroupValue(attrs...)
}
