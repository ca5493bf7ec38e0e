package ledger

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
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
	if t.CAFile != "" {
		cas, err := loadWatched(d, "CA file", parseCAs, tlsFile{t.CAFile, "TLS.CAFile", "the CA file"})
		if err != nil {
			return nil, err
		}
		d.cas = cas
	}
	switch {
	case t.CertFile != "" && t.KeyFile == "":
		return nil, secErr("TLS.KeyFile", "a client certificate needs its key file", nil)
	case t.CertFile == "" && t.KeyFile != "":
		return nil, secErr("TLS.CertFile", "a client key needs its certificate file", nil)
	case t.CertFile != "":
		pair, err := loadWatched(d, "client certificate", parsePair,
			tlsFile{t.CertFile, "TLS.CertFile", "the client certificate"},
			tlsFile{t.KeyFile, "TLS.KeyFile", "the client key"})
		if err != nil {
			return nil, err
		}
		d.pair = pair
	}
	return d, nil
}

// parseCAs is the pool of a PEM bundle of CA certificates.
func parseCAs(files []tlsFile, pems [][]byte) (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pems[0]) {
		return nil, secErr(files[0].field, fmt.Sprintf("no PEM certificate in %s", files[0].path), nil)
	}
	return pool, nil
}

// parsePair is the client certificate of a certificate file and a key
// file. X509KeyPair's errors describe the PEM blocks, never the key.
func parsePair(files []tlsFile, pems [][]byte) (*tls.Certificate, error) {
	pair, err := tls.X509KeyPair(pems[0], pems[1])
	if err != nil {
		return nil, secErr("TLS.CertFile", fmt.Sprintf("%s and %s are not a certificate and its key", files[0].path, files[1].path), err)
	}
	return &pair, nil
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
// timeout. It is safe for concurrent use.
type tlsDialer struct {
	t    TLS
	cas  *watched[*x509.CertPool]   // nil: the system's roots
	pair *watched[*tls.Certificate] // nil: no client certificate

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

// log logs through the client's logger, if it has one.
func (d *tlsDialer) log(level kgo.LogLevel, msg string, keyvals ...any) {
	d.mu.Lock()
	logger := d.logger
	d.mu.Unlock()
	if logger != nil && logger.Level() >= level {
		logger.Log(level, msg, keyvals...)
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
		cfg.RootCAs = d.cas.get()
	}
	if d.pair != nil {
		// Asked for only when the broker requests a certificate.
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return d.pair.get(), nil
		}
	}
	d.mu.Lock()
	timeout := d.timeout
	d.mu.Unlock()
	td := &tls.Dialer{NetDialer: &net.Dialer{Timeout: timeout}, Config: cfg}
	return td.DialContext(ctx, network, addr)
}

// tlsFile is a file of TLS: its path, the field that names it and what
// it holds, for errors.
type tlsFile struct{ path, field, what string }

// watched is a value parsed from files (a CA pool, a client certificate)
// and parsed again when their content changes, looked at on a dial at
// most every tlsReloadEvery. Files that cannot be read or do not parse
// (a rotation caught between the writes of its two files, say) leave the
// last good value in use, with a warning that names the files and the
// error, never their content.
type watched[T any] struct {
	what  string
	files []tlsFile
	parse func([]tlsFile, [][]byte) (T, error)
	d     *tlsDialer // for its logger

	mu      sync.Mutex
	val     T
	sum     [sha256.Size]byte // of the content val was parsed from
	checked time.Time
	failing string // the error last logged, so that it is logged once
}

// loadWatched reads and parses files, and fails with their error.
func loadWatched[T any](d *tlsDialer, what string, parse func([]tlsFile, [][]byte) (T, error), files ...tlsFile) (*watched[T], error) {
	w := &watched[T]{what: what, files: files, parse: parse, d: d}
	pems, sum, err := w.read()
	if err != nil {
		return nil, err
	}
	if w.val, err = parse(files, pems); err != nil {
		return nil, err
	}
	w.sum, w.checked = sum, time.Now()
	return w, nil
}

// read returns the files' content and its digest.
func (w *watched[T]) read() ([][]byte, [sha256.Size]byte, error) {
	h := sha256.New()
	pems := make([][]byte, len(w.files))
	for i, f := range w.files {
		b, err := os.ReadFile(f.path)
		if err != nil {
			return nil, [sha256.Size]byte{}, secErr(f.field, "cannot read "+f.what, err)
		}
		fmt.Fprintf(h, "%d:", len(b))
		h.Write(b)
		pems[i] = b
	}
	return pems, [sha256.Size]byte(h.Sum(nil)), nil
}

// get returns the value of the moment: parsed again if the files changed
// since they were last looked at, and that was tlsReloadEvery ago.
func (w *watched[T]) get() T {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := time.Now()
	if now.Sub(w.checked) < tlsReloadEvery {
		return w.val
	}
	w.checked = now
	pems, sum, err := w.read()
	if err == nil && sum == w.sum {
		w.failing = ""
		return w.val
	}
	var val T
	if err == nil {
		val, err = w.parse(w.files, pems)
	}
	if err != nil {
		if msg := err.Error(); msg != w.failing {
			w.failing = msg
			w.d.log(kgo.LogLevelWarn, "kafka tls "+w.what+" not reloaded, still using the previous one", "files", w.paths(), "err", err)
		}
		return w.val
	}
	w.val, w.sum, w.failing = val, sum, ""
	w.d.log(kgo.LogLevelInfo, "kafka tls "+w.what+" reloaded", "files", w.paths())
	return w.val
}

func (w *watched[T]) paths() []string {
	p := make([]string, len(w.files))
	for i, f := range w.files {
		p[i] = f.path
	}
	return p
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
