package kubetest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// pki is what one API server needs to serve TLS and sign service-account tokens,
// generated in Go for each ControlPlane (ECDSA P-256: fast to generate).
type pki struct {
	caPEM       []byte // CA certificate that clients trust
	certFile    string // serving certificate (127.0.0.1, ::1, localhost, kubernetes.default.svc)
	keyFile     string
	saKeyFile   string // service-account signing key (private)
	saPubFile   string // and its public half, for verification
	tokenFile   string // static tokens: token,user,uid,"groups"
	adminToken  string
	userTokens  map[string]string // user name -> token, for Options.Users
	kcmToken    string            // kube-controller-manager's identity
	kcmUserName string
}

// adminUser is the name of the system:masters identity in the token file.
const adminUser = "kubetest-admin"

// newPKI generates the keys and certificates; the serving certificate also names
// extra (the API server's address when it is not the loopback) and the first
// address of the Service range, which in-cluster clients dial.
func newPKI(dir string, users []string, extra ...net.IP) (*pki, error) {
	p := &pki{
		certFile:    filepath.Join(dir, "serving.crt"),
		keyFile:     filepath.Join(dir, "serving.key"),
		saKeyFile:   filepath.Join(dir, "sa.key"),
		saPubFile:   filepath.Join(dir, "sa.pub"),
		tokenFile:   filepath.Join(dir, "tokens.csv"),
		userTokens:  map[string]string{},
		kcmUserName: "kubetest:kube-controller-manager",
	}
	now := time.Now()
	caCert, caKey, err := p.writeCA(dir, now)
	if err != nil {
		return nil, err
	}
	if err := p.writeServing(caCert, caKey, now, extra); err != nil {
		return nil, err
	}
	if err := p.writeServiceAccountKey(); err != nil {
		return nil, err
	}
	if err := p.writeTokens(users); err != nil {
		return nil, err
	}
	return p, nil
}

// writeCA makes the CA that signs the serving certificate and writes its
// certificate (ca.crt, and p.caPEM).
func (p *pki) writeCA(dir string, now time.Time) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("generate CA key: %w", err)
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "kubetest-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, nil, fmt.Errorf("create CA certificate: %w", err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, nil, fmt.Errorf("parse CA certificate: %w", err)
	}
	p.caPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})
	if err := os.WriteFile(filepath.Join(dir, "ca.crt"), p.caPEM, 0o644); err != nil {
		return nil, nil, fmt.Errorf("write CA certificate: %w", err)
	}
	return caCert, caKey, nil
}

// writeServing writes the API server's serving certificate and key.
func (p *pki) writeServing(caCert *x509.Certificate, caKey *ecdsa.PrivateKey, now time.Time, extra []net.IP) error {
	srvKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("generate serving key: %w", err)
	}
	srvTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "kube-apiserver"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:  append([]net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback, net.IPv4(10, 96, 0, 1)}, extra...),
		DNSNames:     []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
	}
	srvDER, err := x509.CreateCertificate(rand.Reader, srvTmpl, caCert, &srvKey.PublicKey, caKey)
	if err != nil {
		return fmt.Errorf("create serving certificate: %w", err)
	}
	if err := writePEM(p.certFile, "CERTIFICATE", srvDER); err != nil {
		return err
	}
	if err := writeECKey(p.keyFile, srvKey); err != nil {
		return err
	}
	return nil
}

// writeServiceAccountKey writes the key pair that signs service-account tokens.
func (p *pki) writeServiceAccountKey() error {
	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("generate service-account key: %w", err)
	}
	if err := writeECKey(p.saKeyFile, saKey); err != nil {
		return err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return fmt.Errorf("marshal service-account public key: %w", err)
	}
	if err := writePEM(p.saPubFile, "PUBLIC KEY", pubDER); err != nil {
		return err
	}
	return nil
}

// writeTokens writes the static token file: the admin and the
// controller-manager are in system:masters; users are plain users that RBAC
// grants nothing until a test binds them.
func (p *pki) writeTokens(users []string) error {
	p.adminToken, p.kcmToken = randToken(), randToken()
	lines := []string{
		fmt.Sprintf("%s,%s,%s,\"system:masters\"", p.adminToken, adminUser, adminUser),
		fmt.Sprintf("%s,%s,%s,\"system:masters\"", p.kcmToken, p.kcmUserName, p.kcmUserName),
	}
	for _, u := range users {
		if u == "" || u == adminUser || strings.ContainsAny(u, ",\"\n") {
			return fmt.Errorf("bad user name %q", u)
		}
		if _, dup := p.userTokens[u]; dup {
			return fmt.Errorf("user %q listed twice", u)
		}
		tok := randToken()
		p.userTokens[u] = tok
		lines = append(lines, fmt.Sprintf("%s,%s,%s", tok, u, u))
	}
	if err := os.WriteFile(p.tokenFile, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		return fmt.Errorf("write token file: %w", err)
	}
	return nil
}

func randToken() string {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

func writePEM(path, typ string, der []byte) error {
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

func writeECKey(path string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return fmt.Errorf("marshal key for %s: %w", path, err)
	}
	return writePEM(path, "EC PRIVATE KEY", der)
}
