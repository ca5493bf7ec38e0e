package ledgertest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// PKI is a throwaway certificate authority for tests of the TLS paths:
// servers and clients get certificates from it, written as PEM files the
// way an operator would hand them to the ledger's flags.
type PKI struct {
	// Dir holds ca.pem and the issued <name>.pem / <name>-key.pem files.
	Dir string
	// CAFile is the CA certificate's PEM file.
	CAFile string
	// Pool trusts the CA.
	Pool *x509.CertPool

	t    testing.TB
	ca   *x509.Certificate
	key  *ecdsa.PrivateKey
	next int64
}

// NewPKI creates a CA in a temporary directory of t.
func NewPKI(t testing.TB) *PKI {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "ledger test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatalf("pki: create CA: %v", err)
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatalf("pki: parse CA: %v", err)
	}
	p := &PKI{Dir: t.TempDir(), t: t, ca: ca, key: key, next: 2, Pool: x509.NewCertPool()}
	p.Pool.AddCert(ca)
	p.CAFile = filepath.Join(p.Dir, "ca.pem")
	writePEM(t, p.CAFile, "CERTIFICATE", der)
	return p
}

// Pair is an issued certificate: its PEM files and the loaded pair.
type Pair struct {
	CertFile, KeyFile string
	Cert              tls.Certificate
}

// Server issues a server certificate for the names (DNS names or IPs;
// default 127.0.0.1 and localhost), saved as <file>.pem and <file>-key.pem.
func (p *PKI) Server(file string, names ...string) Pair {
	if len(names) == 0 {
		names = []string{"127.0.0.1", "localhost"}
	}
	return p.issue(file, file, x509.ExtKeyUsageServerAuth, names)
}

// Client issues a client certificate whose subject common name is cn.
func (p *PKI) Client(file, cn string) Pair {
	return p.issue(file, cn, x509.ExtKeyUsageClientAuth, nil)
}

func (p *PKI) issue(file, cn string, usage x509.ExtKeyUsage, names []string) Pair {
	t := p.t
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(p.next),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
	}
	p.next++
	for _, n := range names {
		if ip := net.ParseIP(n); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, n)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.key)
	if err != nil {
		t.Fatalf("pki: issue %s: %v", file, err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatalf("pki: marshal key: %v", err)
	}
	pair := Pair{CertFile: filepath.Join(p.Dir, file+".pem"), KeyFile: filepath.Join(p.Dir, file+"-key.pem")}
	writePEM(t, pair.CertFile, "CERTIFICATE", der)
	writePEM(t, pair.KeyFile, "EC PRIVATE KEY", kder)
	if pair.Cert, err = tls.LoadX509KeyPair(pair.CertFile, pair.KeyFile); err != nil {
		t.Fatalf("pki: load %s: %v", file, err)
	}
	return pair
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("pki: key: %v", err)
	}
	return key
}

func writePEM(t testing.TB, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatalf("pki: write %s: %v", path, err)
	}
}

// ReadFile returns the content of path, one of the PKI's files say,
// failing t if it cannot be read.
func ReadFile(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
